"""MTP drafting through the route (DGR-068, docs/mtp.md) on the generated V4 quick twin, whose last
block is an MTP layer. The tail serves the block (--mtp) with a cache of its own and drafts with
llama.cpp's MTP graph after each token; the head puts the drafts into the next step, one forward
crosses the route and the tail verifies. What must hold:

- the tail of a split route drafts exactly what the whole model drafts in one process, and a
  rejected or accepted verification leaves the MTP block's cache as if the kept tokens had been
  decoded one by one;
- through 1-, 2- and 3-stage routes of worker processes, the greedy output with MTP drafts is
  the plain decode's, token for token and logit for logit, bit for bit (a V4 stage verifies each
  drafted row in its own llama_decode: a batch of rows rounds them differently, which moved
  near-tied tokens on the full twin), and drafts were really verified (the twin's weights are
  random, so its drafts are rarely right: the acceptance is recorded, not asserted);
- every refusal names what was wrong: a non-tail or MTP-less engine asked to serve MTP, a tail
  without --mtp asked for MTP drafts, bad draft fields, drafts that come back malformed."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import numpy as np
import pytest
from dgr.v1 import shard_pb2 as pb
from dgr.v1 import shard_pb2_grpc as pb_grpc
from dgr_cli.workers import WorkerProcess, descriptor_args, start_worker
from dgr_route.route import Draft, DraftUsage, Route, RouteError
from dgr_wire.codec import FNV_OFFSET

OPTS = {"n_threads": 2, "n_ctx": 256, "n_batch": 64, "max_sessions": 2}
LAYOUTS = {1: [(0, 6)], 2: [(0, 3), (3, 6)], 3: [(0, 2), (2, 4), (4, 6)]}


def prompt(seed: int, n: int = 24) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1024, n).astype(np.int32)


def greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits[-1]))


def test_the_tail_of_a_split_route_drafts_what_the_whole_model_drafts(
    engine_module: ModuleType, quick_twin: Path
) -> None:
    whole = engine_module.Engine(str(quick_twin), load_mtp=True, **OPTS)
    head = engine_module.Engine(str(quick_twin), 0, 4, **OPTS)
    tail = engine_module.Engine(str(quick_twin), 4, -1, load_mtp=True, **OPTS)
    assert whole.describe()["mtp"] and tail.describe()["mtp"] and not head.describe()["mtp"]
    tokens = prompt(1)
    t_whole = greedy(whole.forward(1, 1, 0, tokens=tokens, mtp=True))
    b = head.forward(1, 1, 0, tokens=tokens)
    t_tail = greedy(tail.forward(1, 1, 0, tokens=tokens, boundary=b, mtp=True))
    assert t_whole == t_tail
    n, token = len(tokens), t_whole
    for _ in range(6):
        drafts = whole.draft_mtp(1, n, token, 4)
        assert len(drafts) == 4 and all(0 <= d < 1024 for d in drafts)
        assert tail.draft_mtp(1, n, token, 4) == drafts
        step = np.array([token], np.int32)
        token = greedy(whole.forward(1, 1, n, tokens=step, mtp=True))
        b = head.forward(1, 1, n, tokens=step)
        assert greedy(tail.forward(1, 1, n, tokens=step, boundary=b, mtp=True)) == token
        n += 1


def test_the_mtp_cache_follows_verification(engine_module: ModuleType, quick_twin: Path) -> None:
    """A verification forward of the last token and three drafts keeps some of them: drafting
    afterwards must equal drafting in a session that decoded only the kept tokens, one at a time
    (the drafts differ between a batched and a one-token forward only by rounding; the greedy
    drafts are the same)."""
    engine = engine_module.Engine(str(quick_twin), load_mtp=True, **OPTS)
    tokens = prompt(2)
    n = len(tokens)
    t0 = greedy(engine.forward(1, 1, 0, tokens=tokens, mtp=True))
    # the plain continuation: t0, t1, t2, ...
    plain, t = [t0], t0
    for i in range(3):
        t = greedy(engine.forward(1, 1, n + i, tokens=np.array([t], np.int32), mtp=True))
        plain.append(t)
    reference = {}
    for keep in (1, 2, 3):  # kept tokens of the verification: t0, then keep - 1 of the plain ones
        ref = engine_module.Engine(str(quick_twin), load_mtp=True, **OPTS)
        ref.forward(7, 1, 0, tokens=tokens, mtp=True)
        for i in range(keep):
            ref.forward(7, 1, n + i, tokens=np.array([plain[i]], np.int32), mtp=True)
        reference[keep] = ref.draft_mtp(7, n + keep, plain[keep], 3)
    for keep in (1, 2, 3):
        engine.forward(2, 1, 0, tokens=tokens, mtp=True)
        # t0 and three drafts: the plain ones up to keep, then a wrong one
        drafts = [*plain[1:keep], (plain[keep] + 1) % 1024, 5, 6, 7][:3]
        step = np.array([t0, *drafts], np.int32)
        logits = engine.forward(2, 1, n, tokens=step, logits_all=True, mtp=True)
        verified = [int(np.argmax(row)) for row in logits]
        assert verified[:keep] == plain[1 : keep + 1]
        assert engine.draft_mtp(2, n + keep, plain[keep], 3) == reference[keep], keep
        # the next forward drops the rejected positions everywhere, the MTP block included
        nxt = engine.forward(
            2, 1, n + keep, tokens=np.array([plain[keep]], np.int32), truncate=True, mtp=True
        )
        assert nxt.shape[0] == 1
        engine.release(2)


def test_engine_refusals_name_what_was_wrong(
    engine_module: ModuleType, quick_twin: Path, smollm2: Path
) -> None:
    def refused(status: str, needle: str, fn, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        with pytest.raises(engine_module.ShardError, match=needle) as info:
            fn(*args, **kwargs)
        assert info.value.status == status

    Engine = engine_module.Engine
    refused(
        "invalid_range",
        r"reaches into the MTP block \(layers 6\.\.6\)",
        Engine,
        str(quick_twin),
        3,
        7,
        **OPTS,
    )
    refused(
        "invalid_argument",
        r"only the tail serves the MTP block",
        Engine,
        str(quick_twin),
        0,
        3,
        load_mtp=True,
        **OPTS,
    )
    refused(
        "invalid_argument",
        r"has no MTP \(nextn\) block",
        Engine,
        str(smollm2),
        20,
        -1,
        load_mtp=True,
        **OPTS,
    )
    plain = Engine(str(quick_twin), 3, -1, **OPTS)
    b = np.zeros((4, 256), np.float32)
    refused(
        "invalid_argument",
        r"does not serve the MTP block",
        plain.forward,
        1,
        1,
        0,
        tokens=prompt(3, 4),
        boundary=b,
        mtp=True,
    )
    assert plain.sessions() == []  # a refused forward holds no slot
    tail = Engine(str(quick_twin), 3, -1, load_mtp=True, **OPTS)
    refused("invalid_argument", r"token ids needed", tail.forward, 1, 1, 0, boundary=b, mtp=True)
    tail.forward(1, 1, 0, tokens=prompt(3, 4), boundary=b, mtp=True)
    refused("unknown_session", r"no session 9", tail.draft_mtp, 9, 4, 1, 2)
    refused("invalid_argument", r"n_keep 5 outside \[1, 4\]", tail.draft_mtp, 1, 5, 1, 2)
    refused("invalid_argument", r"n_keep 0", tail.draft_mtp, 1, 0, 1, 2)
    refused("invalid_argument", r"token id 1024 outside", tail.draft_mtp, 1, 4, 1024, 2)
    assert len(tail.draft_mtp(1, 4, 1, 2)) == 2
    # a forward without `mtp` leaves the block behind: no drafts until a new prefill, no error
    tail.forward(1, 1, 4, tokens=prompt(4, 1), boundary=b[:1])
    assert tail.draft_mtp(1, 5, 1, 2) == []
    # drafts never run past the context
    short = Engine(str(quick_twin), load_mtp=True, n_threads=2, n_ctx=8, n_batch=8, max_sessions=1)
    short.forward(1, 1, 0, tokens=prompt(5, 6), mtp=True)
    assert len(short.draft_mtp(1, 6, 1, 8)) == 2


def route_error(stub: pb_grpc.ShardServiceStub, *requests: pb.ForwardRequest) -> pb.StageError:
    """The StageError a forward-mode head returns for `requests` (its stream stays open, as a
    coordinator's does, until the error comes back)."""
    done = threading.Event()

    def send() -> Iterator[pb.ForwardRequest]:
        yield from requests
        done.wait(30)

    try:
        for reply in stub.Forward(send(), timeout=30):
            if reply.HasField("error"):
                return reply.error
    except grpc.RpcError as err:
        raise AssertionError(f"no StageError before the stream ended: {err}") from err
    finally:
        done.set()
    raise AssertionError("no StageError: the route accepted the requests")


@pytest.fixture(scope="module")
def fleet(quick_twin: Path) -> Iterator[dict[tuple[int, int], WorkerProcess]]:
    descriptor = descriptor_args(quick_twin)
    ranges = sorted({r for layout in LAYOUTS.values() for r in layout})
    started = {
        r: start_worker(
            quick_twin, *r, descriptor=descriptor, n_ctx=512, extra=["--mtp"] if r[1] == 6 else []
        )
        for r in ranges
    }
    yield started
    for w in started.values():
        w.stop()


@pytest.mark.parametrize("n_stages", [1, 2, 3])
def test_greedy_output_with_mtp_drafts_equals_plain_decode(
    fleet: dict[tuple[int, int], WorkerProcess], n_stages: int
) -> None:
    addresses = [fleet[r].address for r in LAYOUTS[n_stages]]
    plain = Route.open(addresses, timeout=60)
    drafted = Route.open(addresses, timeout=60, draft=Draft("mtp", max_draft=4))
    assert drafted.stages[-1].describe.mtp
    usages = []
    for seed in (11, 12):
        tokens = [int(t) for t in prompt(seed, 40)]
        expected = list(plain.trace(tokens, 40))
        usage = DraftUsage()
        got = list(drafted.trace(tokens, 40, usage=usage))
        assert [t for t, _ in got] == [t for t, _ in expected], seed
        for step, ((_, mine), (_, want)) in enumerate(zip(got, expected, strict=True)):
            assert np.array_equal(mine, want), (seed, step)
        assert 0 <= usage.accepted <= usage.drafted
        usages.append(usage)
    # drafts were proposed and verified: the route's first generation starts from the prior
    # and probes by its 16th step at the latest; the next starts from the acceptance the first
    # measured, on this random-weight twin 0, and may send no draft at all
    assert usages[0].drafted > 0, usages
    plain.close()
    drafted.close()


def test_concurrent_sessions_with_mtp_drafts_keep_their_own_output(
    fleet: dict[tuple[int, int], WorkerProcess],
    concurrently: Callable[..., list[Any]],
) -> None:
    """Sessions that reach the tail together each keep their own MTP trail. (This test found that
    a V4 stage after the head aborted on a batch of several sessions: llama.cpp splits it into a
    ubatch per sequence, and a staged boundary serves one; such a stage now computes them one
    llama_decode each.)"""
    from dgr_bench.bench_wan import linked

    # a route of its own (through links that add nothing): the head keeps a route's probing
    # across generations, and the earlier tests' routes through these workers backed off theirs
    with linked([fleet[r].address for r in LAYOUTS[2]], 0.0) as addresses:
        plain = Route.open(addresses, timeout=60, peers=addresses)
        drafted = Route.open(
            addresses, timeout=60, peers=addresses, draft=Draft("mtp", max_draft=4)
        )
        prompts = [[int(t) for t in prompt(30 + i, 30 + 5 * i)] for i in range(3)]
        alone = [list(plain.generate(p, 32)) for p in prompts]
        usages = [DraftUsage() for _ in prompts]
        together = concurrently(
            lambda i: [int(r.token_id) for r in drafted.results(prompts[i], 32, usage=usages[i])],
            len(prompts),
            120,
        )
        plain.close()
        drafted.close()
    assert together == alone
    assert all(u.drafted > 0 for u in usages), usages


def test_a_route_whose_mtp_drafts_fail_stops_drafting_in_later_generations(
    fleet: dict[tuple[int, int], WorkerProcess],
) -> None:
    """The head keeps a route's MTP acceptance across generations. Behind 10 ms links, where a
    measured draft costs little beside a trip, generations that each started again from the
    prior of 1/2 drafted 8-10 times on this random-weight twin, whose drafts are hardly ever
    accepted (the previous worker: 2, 10, 8, 8 drafts over these four, 1 accepted). Starting
    from what the route's earlier generations measured, later ones send at most their probes
    (one after 16 steps, then ever rarer): 1, 1, 0, 0."""
    from dgr_bench.bench_wan import linked

    with linked([fleet[r].address for r in LAYOUTS[3]], 10.0) as addresses:
        drafted = Route.open(
            addresses, timeout=60, peers=addresses, draft=Draft("mtp", max_draft=4)
        )
        usages = []
        for seed in (40, 41, 42, 43):
            usage = DraftUsage()
            list(drafted.results([int(t) for t in prompt(seed, 40)], 40, usage=usage))
            usages.append(usage)
        drafted.close()
    assert all(u.accepted == 0 for u in usages), usages  # the twin's drafts fail (its premise)
    assert usages[0].drafted > 0, usages  # the first generation measured p and beta
    assert all(u.drafted <= 2 for u in usages[1:]), usages  # probes only


def test_the_coordinator_and_workers_refuse_mtp_they_cannot_run(
    fleet: dict[tuple[int, int], WorkerProcess],
) -> None:
    head, tail = fleet[(0, 3)], fleet[(3, 6)]
    stub = pb_grpc.ShardServiceStub(grpc.insecure_channel(head.address))
    route = pb.RouteSpec(stages=[head.address, tail.address])

    mtp = pb.Draft(source=pb.DRAFT_SOURCE_MTP, max_draft=4)

    def chunk(i: int, last: bool, draft: pb.Draft | None, session: int = 800) -> pb.ForwardRequest:
        return pb.ForwardRequest(
            session_id=session,
            expect=pb.CacheExpectation(epoch=1, n_past=0 if i == 0 else 8, prefix_hash=FNV_OFFSET),
            token_ids=list(range(1, 9)),
            route=route,
            chunk_index=i,
            last_chunk=last,
            max_tokens=4 if last else 0,
            draft=draft,
        )

    for k, (bad, needle) in enumerate(
        [
            (
                pb.Draft(source=pb.DRAFT_SOURCE_MTP, max_draft=4, ngram_min=1, ngram_max=2),
                "draft.ngram_min/ngram_max",
            ),
            (
                pb.Draft(source=pb.DRAFT_SOURCE_MTP, max_draft=4, propose=5),
                "draft.propose: 5 outside [0, max_draft 4]",
            ),
            (pb.Draft(source=pb.DRAFT_SOURCE_MTP, max_draft=0), "draft.max_draft"),
            (
                pb.Draft(
                    source=pb.DRAFT_SOURCE_LOOKUP, max_draft=4, ngram_min=1, ngram_max=2, propose=1
                ),
                "an MTP field",
            ),
        ]
    ):
        error = route_error(stub, chunk(0, True, bad, session=810 + k))
        assert error.stage == 0 and error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], bad
        assert needle in error.message, bad
    # the Draft on the last chunk only: the tail's block could not follow the first
    error = route_error(stub, chunk(0, False, None), chunk(1, True, mtp))
    assert "needs the Draft on every prefill chunk" in error.message


def test_a_tail_without_mtp_refuses_mtp_drafts(quick_twin: Path) -> None:
    descriptor = descriptor_args(quick_twin)
    head = start_worker(quick_twin, 0, 3, descriptor=descriptor, n_ctx=256)
    tail = start_worker(quick_twin, 3, 6, descriptor=descriptor, n_ctx=256)
    try:
        with pytest.raises(RouteError, match=r"start the tail with --mtp") as info:
            Route.open([head.address, tail.address], draft=Draft("mtp"))
        assert info.value.stage == 1
        # asked anyway, the tail refuses and the head relays it by stage
        stub = pb_grpc.ShardServiceStub(grpc.insecure_channel(head.address))
        request = pb.ForwardRequest(
            session_id=1,
            expect=pb.CacheExpectation(epoch=1, prefix_hash=FNV_OFFSET),
            token_ids=list(range(1, 9)),
            route=pb.RouteSpec(stages=[head.address, tail.address]),
            last_chunk=True,
            max_tokens=4,
            draft=pb.Draft(source=pb.DRAFT_SOURCE_MTP, max_draft=4),
        )
        error = route_error(stub, request)
        assert error.stage == 1 and error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        assert "start it with --mtp" in error.message
    finally:
        head.stop()
        tail.stop()
