"""Speculative decoding through the route (prompt-lookup drafts, issue 14): real workers on
loopback. The head drafts, one forward of the last token and its drafts crosses the route, the
tail verifies and every stage drops the rejected drafts (CacheExpectation.truncate). Output must
equal plain decode token for token, greedy and sampled, and drafts must really be accepted;
rollback in the engine restores the cache exactly; bad draft fields are refused by name."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import numpy as np
import pytest
from dgr.v1 import shard_pb2 as pb
from dgr.v1 import shard_pb2_grpc as pb_grpc
from dgr_cli.workers import WorkerProcess, descriptor_args, start_worker
from dgr_route.route import Draft, DraftUsage, Route, RouteError, Sampling
from dgr_wire.codec import FNV_OFFSET, encode, prefix_hash

LAYOUTS = {1: [(0, 30)], 2: [(0, 15), (15, 30)], 3: [(0, 10), (10, 20), (20, 30)]}
QUOTE = (
    "Repeat the following text exactly.\n\nThe quick brown fox jumps over the lazy dog. A "
    "journey of a thousand miles begins with a single step. All that glitters is not gold, and "
    "not all those who wander are lost.\n\nRepeated text:\n"
)


@pytest.fixture(scope="module")
def workers(smollm2: Path, worker_pool: Any) -> dict[tuple[int, int], WorkerProcess]:
    descriptor = descriptor_args(smollm2)
    ranges = sorted({r for layout in LAYOUTS.values() for r in layout})
    return {r: worker_pool.get(smollm2, *r, descriptor=descriptor, n_ctx=512) for r in ranges}


@pytest.fixture(scope="module")
def quote(smollm2: Path, engine_module: ModuleType) -> list[int]:
    return list(engine_module.Vocabulary(str(smollm2)).tokenize(QUOTE))


def routes(
    workers: dict[tuple[int, int], WorkerProcess], n_stages: int, **draft: int
) -> tuple[Route, Route]:
    addresses = [workers[r].address for r in LAYOUTS[n_stages]]
    return Route.open(addresses, timeout=60), Route.open(
        addresses, timeout=60, draft=Draft("lookup", **draft)
    )


@pytest.mark.parametrize("n_stages", [1, 2, 3])
def test_greedy_drafted_output_equals_plain_decode(
    workers: dict[tuple[int, int], WorkerProcess], quote: list[int], n_stages: int
) -> None:
    plain, drafted = routes(workers, n_stages)
    expected = list(plain.generate(quote, 48))
    usage = DraftUsage()
    got = [int(r.token_id) for r in drafted.results(quote, 48, usage=usage)]
    assert got == expected
    # the quote recurs in the prompt: drafts were verified and accepted (how many the controller
    # sends depends on the trip time it measures, which the machine's load moves: faster links
    # make it draft less)
    assert usage.accepted >= 1 and usage.drafted >= usage.accepted, usage
    plain.close()
    drafted.close()


def test_lookup_sends_no_draft_its_proposals_would_not_have_kept(
    workers: dict[tuple[int, int], WorkerProcess], smollm2: Path, engine_module: ModuleType
) -> None:
    """The head checks what prompt lookup would draft against the tokens plain decode returns
    (for free) and drafts only once a proposal held: on free-form text, whose n-grams recur
    without the continuation recurring, not one draft crosses the route."""
    plain, drafted = routes(workers, 3)
    prompt = list(
        engine_module.Vocabulary(str(smollm2)).tokenize(
            "Write a short story about a lighthouse keeper who finds a strange map.\n\n"
        )
    )
    usage = DraftUsage()
    got = [int(r.token_id) for r in drafted.results(prompt, 64, usage=usage)]
    assert got == list(plain.generate(prompt, 64))
    assert usage.drafted == 0, usage
    plain.close()
    drafted.close()


def test_a_generation_starts_from_the_step_costs_its_route_measured_before(
    smollm2: Path, quote: list[int]
) -> None:
    """What a route's steps cost is the route's, not one generation's: the head keeps it, and
    the next generation over the same route drafts from its first proposal that held, with no
    plain steps timed first (a fresh head, so no earlier test's route is in its memory)."""
    worker = start_worker(smollm2, 0, 30, descriptor=descriptor_args(smollm2), n_ctx=512)
    try:
        route = Route.open([worker.address], timeout=60, draft=Draft("lookup"))
        first, second = DraftUsage(), DraftUsage()
        a = [int(r.token_id) for r in route.results(quote, 4, usage=first)]
        b = [int(r.token_id) for r in route.results(quote, 4, usage=second)]
        assert a == b
        # the first generation times two plain steps before it may draft; by then one draft more
        # would pass max_tokens
        assert first.drafted == 0, first
        # the second: a plain step whose proposal held, then one draft (all that max_tokens leaves)
        assert (second.drafted, second.accepted) == (1, 1), second
        route.close()
    finally:
        worker.stop()


def test_drafts_stop_at_max_tokens_and_at_a_stop_token(
    workers: dict[tuple[int, int], WorkerProcess], quote: list[int]
) -> None:
    plain, drafted = routes(workers, 2, max_draft=16)
    full = list(plain.generate(quote, 30))
    for n in (1, 7, 30):  # a verified step that overshoots is cut where the generation ends
        assert list(drafted.generate(quote, n)) == full[:n]
    stop = full[12]
    first = full.index(stop)
    assert list(drafted.generate(quote, 30, stop={stop})) == full[: first + 1]
    plain.close()
    drafted.close()


def test_the_engine_rolls_back_rejected_drafts(smollm2: Path, engine_module: ModuleType) -> None:
    """Truncation restores the cache exactly: a session that drafted 5 tokens, kept 2 and went on
    gives the logits of a session that only ever saw the kept ones."""
    engine = engine_module.Engine(str(smollm2), 0, -1, n_threads=2, n_ctx=128, max_sessions=2)
    prompt = np.array([1000 + 7 * i for i in range(12)], np.int32)
    drafts = np.array([11, 22, 33, 44, 55], np.int32)
    nxt = np.array([99, 98], np.int32)
    h = prefix_hash([int(t) for t in prompt], FNV_OFFSET)
    engine.forward(1, 1, 0, tokens=prompt)
    engine.forward(1, 1, 12, tokens=drafts, logits_all=True)
    kept = prefix_hash([11, 22], h)
    with pytest.raises(engine_module.ShardError, match="expects n_past 14 but the shard holds 17"):
        engine.forward(1, 1, 14, tokens=nxt)  # without truncate: a mismatch, as before
    got = engine.forward(1, 1, 14, tokens=nxt, truncate=True)
    engine.forward(2, 1, 0, tokens=np.concatenate([prompt, drafts[:2]]))
    want = engine.forward(2, 1, 14, tokens=nxt)
    assert np.array_equal(got, want)
    # the prefix hash rolled back with the cache: the kept history's hash is what it checks
    with pytest.raises(engine_module.ShardError, match="prefix hash differs"):
        engine.forward(1, 1, 14, tokens=nxt, truncate=True, prefix_hash=kept ^ 1)
    assert engine.forward(1, 1, 14, tokens=nxt, truncate=True, prefix_hash=kept) is not None


def forward_refusal(worker: WorkerProcess, request: pb.ForwardRequest) -> grpc.RpcError:
    stub = pb_grpc.ShardServiceStub(grpc.insecure_channel(worker.address))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Forward(iter([request]), timeout=30))
    return info.value


@pytest.mark.parametrize(
    "fields,code,needle",
    [
        ({"n_draft": 3, "token_ids": [1, 2, 3]}, "INVALID_ARGUMENT", "n_draft"),
        ({"n_draft": 17, "token_ids": list(range(1, 19))}, "INVALID_ARGUMENT", "n_draft"),
        ({"draft": pb.Draft(source=pb.DRAFT_SOURCE_MTP)}, "INVALID_ARGUMENT", "draft.max_draft"),
        ({"draft": pb.Draft(source=7)}, "INVALID_ARGUMENT", "draft.source"),
        (
            {
                "draft": pb.Draft(
                    source=pb.DRAFT_SOURCE_LOOKUP, max_draft=0, ngram_min=1, ngram_max=2
                )
            },
            "INVALID_ARGUMENT",
            "draft.max_draft",
        ),
        (
            {
                "draft": pb.Draft(
                    source=pb.DRAFT_SOURCE_LOOKUP, max_draft=4, ngram_min=3, ngram_max=2
                )
            },
            "INVALID_ARGUMENT",
            "draft.ngram_min",
        ),
        (
            {
                "draft": pb.Draft(
                    source=pb.DRAFT_SOURCE_LOOKUP, max_draft=4, ngram_min=1, ngram_max=9
                )
            },
            "INVALID_ARGUMENT",
            "draft.ngram_max",
        ),
    ],
)
def test_bad_draft_fields_are_refused_by_name(
    workers: dict[tuple[int, int], WorkerProcess],
    fields: dict[str, object],
    code: str,
    needle: str,
) -> None:
    request = pb.ForwardRequest(
        session_id=900,
        expect=pb.CacheExpectation(epoch=1, prefix_hash=FNV_OFFSET),
        token_ids=fields.pop("token_ids", [1, 2, 3]),  # type: ignore[arg-type]
        **fields,  # type: ignore[arg-type]
    )
    err = forward_refusal(workers[(0, 30)], request)
    assert err.code() == getattr(grpc.StatusCode, code)
    assert needle in (err.details() or "")


def part(
    session: int, route: list[str], index: int, tokens: list[int], **fields: object
) -> pb.ForwardRequest:
    """A forward-mode request to the stage at `index` of `route`: a part of a drafted step."""
    return pb.ForwardRequest(
        session_id=session,
        expect=pb.CacheExpectation(epoch=1, prefix_hash=FNV_OFFSET),
        token_ids=tokens,
        route=pb.RouteSpec(stages=route, stage_index=index),
        **fields,  # type: ignore[arg-type]
    )


def test_parts_of_a_drafted_step_are_checked_by_name(
    workers: dict[tuple[int, int], WorkerProcess],
) -> None:
    """A drafted step in parts (forward mode): a later part holds drafts only, and the tail takes
    parts only in order, after the part 0 that opened the step; MTP steps travel whole."""
    head, tail = workers[(0, 15)].address, workers[(15, 30)].address
    route = [head, tail]
    cases = [
        # a later part whose first token would be the last accepted one: not drafts only
        (head, 0, part(910, route, 0, [1, 2, 3], n_draft=2, chunk_index=1), "n_draft"),
        (
            head,
            0,
            part(
                911,
                route,
                0,
                [1, 2],
                n_draft=1,
                draft=pb.Draft(source=pb.DRAFT_SOURCE_MTP, max_draft=2),
            ),
            "an MTP step travels whole",
        ),
        # the tail: part 1 of a step whose part 0 it never saw
        (tail, 1, None, "part 0 did not come"),
    ]
    for address, index, request, needle in cases:
        if request is None:  # a boundary from the (absent) head, for the tail's layers
            n_embd = 576
            boundary = encode(np.zeros((2, n_embd), np.float32), "f32")
            request = part(912, route, index, [5, 6], n_draft=2, chunk_index=1, boundary=boundary)
        # the head reports a failure as the stream's last reply (a StageError naming the stage)
        # and ends it; a later stage as the stream's status
        stub = pb_grpc.ShardServiceStub(grpc.insecure_channel(address))
        replies: list[pb.ForwardReply] = []
        with pytest.raises(grpc.RpcError) as info:
            for reply in stub.Forward(iter([request]), timeout=30):
                replies.append(reply)
        if index == 0:
            [reply] = replies
            invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert (reply.error.stage, reply.error.code) == (0, invalid)
            assert needle in reply.error.message, reply.error.message
        else:
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, needle
            assert needle in (info.value.details() or ""), info.value.details()


@contextmanager
def behind_links(
    model: Path,
    layout: list[tuple[int, int]],
    delay_ms: float,
    extra: list[str] | None = None,
) -> Iterator[tuple[list[WorkerProcess], list[str]]]:
    """Workers for `layout`, each behind a dgr-netsim link adding `delay_ms` each way, as a WAN
    would; yields them and the links' addresses (what the coordinator and the stages reach)."""
    from dgr_bench.bench_wan import linked

    descriptor = descriptor_args(model)
    fleet = [
        start_worker(model, a, b, descriptor=descriptor, n_ctx=512, extra=extra) for a, b in layout
    ]
    try:
        with linked([w.address for w in fleet], delay_ms) as addresses:
            yield fleet, addresses
    finally:
        for w in fleet:
            w.stop()


@pytest.fixture(scope="module")
def slow(smollm2: Path) -> Iterator[tuple[list[WorkerProcess], list[str]]]:
    """A 3-stage route whose every link adds 10 ms: drafting pays there (on loopback the head
    may rightly stop drafting once it has timed the route)."""
    with behind_links(smollm2, LAYOUTS[3], 10.0, ["--metrics-listen", "127.0.0.1:0"]) as route:
        yield route


def test_drafted_steps_go_in_parts_behind_slow_links(
    slow: tuple[list[WorkerProcess], list[str]], quote: list[int]
) -> None:
    """Where a trip takes longer than the stages' compute, the head sends a drafted step in parts
    that the stages pipeline, and the tail replies at the first rejected draft: the output is
    still plain decode's, token for token."""
    fleet, addresses = slow
    plain = Route.open(addresses, peers=addresses)
    drafted = Route.open(addresses, peers=addresses, draft=Draft("lookup"))
    expected = list(plain.generate(quote, 48))
    usage = DraftUsage()
    for _ in range(2):  # the first generation times the route's steps
        assert [int(r.token_id) for r in drafted.results(quote, 48, usage=usage)] == expected
    assert usage.accepted > 0, usage
    in_parts = metric(fleet[0], "dgr:draft_steps_in_parts_total")
    skipped = metric(fleet[-1], "dgr:draft_parts_skipped_total")
    assert in_parts > 0, (in_parts, skipped, usage)
    print(f"steps in parts {in_parts}, parts the tail skipped {skipped}, {usage}")
    plain.close()
    drafted.close()


def test_a_stage_that_dies_while_steps_go_in_parts_is_named(
    smollm2: Path, quote: list[int]
) -> None:
    """A middle stage killed while drafted steps go in parts: the coordinator gets a RouteError
    naming it within the route's deadline, with the tokens generated before it; nothing hangs."""
    import threading

    with behind_links(smollm2, LAYOUTS[3], 10.0) as (fleet, addresses):
        route = Route.open(addresses, peers=addresses, timeout=20, draft=Draft("lookup"))
        list(route.generate(quote, 48))  # the route's steps timed: the next generation splits
        got: list[int] = []
        killer = threading.Timer(0.8, fleet[1].proc.kill)
        killer.start()
        with pytest.raises(RouteError) as info:
            for token in route.generate(quote, 400):
                got.append(token)
        killer.join()
        assert info.value.stage == 1, info.value
        assert 0 < len(got) < 400
        route.close()


def test_sampled_drafted_output_equals_plain_decode(
    slow: tuple[list[WorkerProcess], list[str]], quote: list[int]
) -> None:
    """Each position is sampled as plain decode samples it (seeded by position), so a draft is
    kept exactly when plain decode would have drawn it: the same tokens, not only the same
    distribution (steps in parts included)."""
    _, addresses = slow
    plain = Route.open(addresses, peers=addresses)
    drafted = Route.open(addresses, peers=addresses, draft=Draft("lookup"))
    for seed in (1, 2):
        sampling = Sampling(temperature=0.7, top_k=40, top_p=0.95, seed=seed)
        usage = DraftUsage()
        expected = list(plain.generate(quote, 40, sampling))
        got = [int(r.token_id) for r in drafted.results(quote, 40, sampling, usage=usage)]
        assert got == expected
        assert usage.accepted > 0, usage
    plain.close()
    drafted.close()


def metric(worker: WorkerProcess, name: str) -> float:
    return float(worker.metrics_json()[name])


def test_the_coordinator_refuses_drafts_it_cannot_run(
    workers: dict[tuple[int, int], WorkerProcess],
) -> None:
    with pytest.raises(ValueError, match="draft 'medusa' is not one of"):
        Draft("medusa")
    with pytest.raises(ValueError, match="max_draft 17"):
        Draft("lookup", max_draft=17)
    with pytest.raises(ValueError, match="needs forward mode"):
        Route.open([workers[(0, 30)].address], mode="relay", draft=Draft("lookup"))


def test_v4_twin_drafts_roll_back_through_state_snapshots(quick_twin: Path) -> None:
    """DeepSeek V4's compressor state is not positional: its stages drop rejected drafts through
    llama.cpp's state snapshots (--rollback, n_rs_seq), and the output stays plain decode's, its
    logits bit for bit. A V4 stage verifies a step's rows one llama_decode each, so drafting pays
    only where trips cost more than compute: every link here adds 5 ms (dgr-netsim), as a WAN
    would, or the head would rightly stop drafting."""
    with behind_links(quick_twin, [(0, 2), (2, 3), (3, 6)], 5.0) as (_, addresses):
        plain = Route.open(addresses, peers=addresses)
        drafted = Route.open(addresses, peers=addresses, draft=Draft("lookup"))
        assert [s.describe.max_rollback for s in drafted.stages] == [16, 16, 16]
        # how many drafts the adaptive head sends depends on the trips it times: prompts until
        # drafts were both kept and rolled back, each output checked against plain decode
        usage = DraftUsage()
        for seed in range(5, 11):
            third = [int(t) for t in np.random.default_rng(seed).integers(0, 1024, 40)]
            prompt = third * 3
            got = list(drafted.trace(prompt, 40, usage=usage))
            want = list(plain.trace(prompt, 40))
            assert [t for t, _ in got] == [t for t, _ in want], seed
            assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(got, want, strict=True))
            if usage.accepted > 0 and usage.drafted > usage.accepted:
                break
        assert usage.accepted > 0 and usage.drafted > usage.accepted, usage  # kept and rolled back
        plain.close()
        drafted.close()


def test_a_stage_that_cannot_roll_back_refuses_drafting(
    quick_twin: Path, workers: dict[tuple[int, int], WorkerProcess]
) -> None:
    whole = start_worker(
        quick_twin,
        0,
        6,
        descriptor=descriptor_args(quick_twin),
        n_ctx=256,
        extra=["--rollback", "0"],
    )
    try:
        with pytest.raises(RouteError, match="start it with --rollback N") as info:
            Route.open([whole.address], draft=Draft("lookup"))
        assert info.value.stage == 0
        Route.open([whole.address]).close()  # plain decode is unaffected
    finally:
        whole.stop()
    # a positional cache drops any number of positions: the coordinator keeps max_draft
    route = Route.open([workers[(0, 30)].address], draft=Draft("lookup", max_draft=16))
    assert route.stages[0].describe.max_rollback == 512 and route.draft.max_draft == 16
    route.close()


def test_a_relay_request_verifies_drafts_after_a_longer_prefix(
    workers: dict[tuple[int, int], WorkerProcess], quote: list[int]
) -> None:
    """Drafts at the end of a multi-token request (a client in relay mode may send them): the
    kept history is the request's tokens up to the last accepted draft, and its prefix hash is
    theirs, continuing from the expectation."""
    stub = pb_grpc.ShardServiceStub(grpc.insecure_channel(workers[(0, 30)].address))
    tokens = quote[:40]
    drafts = quote[40:44]
    [reply] = list(
        stub.Forward(
            iter(
                [
                    pb.ForwardRequest(
                        session_id=901,
                        expect=pb.CacheExpectation(epoch=1, prefix_hash=FNV_OFFSET),
                        token_ids=tokens + drafts,
                        n_draft=len(drafts),
                    )
                ]
            ),
            timeout=30,
        )
    )
    stub.CloseSession(pb.CloseSessionRequest(session_id=901), timeout=10)
    accepted = len(reply.more_tokens)
    assert reply.accepted == accepted and reply.drafted == len(drafts)
    assert reply.n_past == len(tokens) + accepted
    assert reply.prefix_hash == prefix_hash(tokens + drafts[:accepted], FNV_OFFSET)


def test_dgr_worker_passes_the_part_size_to_the_worker(tmp_path: Path) -> None:
    """`dgr worker --draft-part-rows N` reaches the worker, which refuses a size it cannot split
    by (part 0 holds the last accepted token and at least one draft)."""
    import subprocess
    import sys

    dgr = str(Path(sys.executable).parent / "dgr")
    out = subprocess.run(
        [dgr, "worker", "--layers", "0:15", "--draft-part-rows", "1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 2, out
    assert "--draft-part-rows: 0 (whole steps) or 2..64" in out.stderr, out.stderr
