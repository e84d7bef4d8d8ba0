"""Prefix reuse across generations (issue 47): each stage keeps finished sessions' KV, a new
generation whose prompt starts with a kept history computes only the rest, and the result is the
same bits as a full prefill; a stage that lost the entry refuses and the route prefills from 0.

Real workers, a 3-stage SmolLM2 route, contexts past 300 tokens (short prompts hide the kernel
differences that made a suffix prefilled after a reused prefix differ from a full prefill)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from dgr.v1 import shard_pb2 as pb
from dgr.v1 import shard_pb2_grpc as pb_grpc
from dgr_cli.workers import WorkerProcess, descriptor_args, start_worker
from dgr_route.route import DraftUsage, Route, Sampling

LAYOUT = [(0, 10), (10, 20), (20, 30)]
PROSE = (
    "The river town woke slowly. Fishermen pulled their boats onto the gravel, the baker opened "
    "his shutters, and the schoolteacher walked the long way round the square so that she could "
    "look at the water. Nobody in the town remembered when the bridge had been built, only that "
    "it had always been there, grey and patient, carrying carts and children and the occasional "
    "lost goat from one bank to the other. "
)
TURNS = [
    " Tell me what happens next in the story.",
    " Now describe the bridge in more detail, please.",
    " And what did the schoolteacher see in the water?",
]


def _workers(smollm2: Path, threads: int, extra: dict[int, list[str]]) -> list[WorkerProcess]:
    descriptor = descriptor_args(smollm2)
    return [
        start_worker(
            smollm2,
            a,
            b,
            descriptor=descriptor,
            threads=threads,
            n_ctx=1024,
            extra=["--metrics-listen", "127.0.0.1:0", *extra.get(i, [])],
        )
        for i, (a, b) in enumerate(LAYOUT)
    ]


@pytest.fixture(scope="module", params=[1, 2], ids=["1-thread", "2-threads"])
def fleet(smollm2: Path, request: pytest.FixtureRequest) -> Iterator[list[WorkerProcess]]:
    workers = _workers(smollm2, request.param, {})
    yield workers
    for w in workers:
        w.stop()


def _conversation(
    route: Route, tokenizer: object, n_tokens: int = 24
) -> list[tuple[list[int], np.ndarray, int, int]]:
    """Three turns, each prompt the whole conversation so far: (tokens, logits, prompt length,
    cached tokens) per turn."""
    history = tokenizer.encode(PROSE * 4)  # type: ignore[attr-defined]
    assert len(history) > 300
    out = []
    for turn in TURNS:
        history = history + list(tokenizer.vocab.tokenize(turn, False))  # type: ignore[attr-defined]
        usage = DraftUsage()
        tokens, logits = [], []
        for result in route.results(history, n_tokens, Sampling(want_logits=True), usage=usage):
            tokens.append(int(result.token_id))
            logits.append(np.frombuffer(result.logits.payload, dtype=np.float32))
        out.append((tokens, np.stack(logits), len(history), usage.cached_tokens))
        history = history + tokens
    return out


def test_a_conversation_reusing_its_prefix_equals_full_prefills_bitwise(
    smollm2: Path, fleet: list[WorkerProcess]
) -> None:
    from dgr_route.tokenizer import Tokenizer

    tokenizer = Tokenizer(smollm2)
    addresses = [w.address for w in fleet]
    full = Route.open(addresses, timeout=120, prefix_reuse=False)
    reference = _conversation(full, tokenizer)
    full.close()
    before = [w.metrics_json(timeout=5) for w in fleet]
    reused = Route.open(addresses, timeout=120)
    got = _conversation(reused, tokenizer)
    reused.close()
    deadline = time.monotonic() + 5  # the stages free (and keep) their sessions as streams end
    while any(w.sessions() for w in fleet) and time.monotonic() < deadline:
        time.sleep(0.05)
    after = [w.metrics_json(timeout=5) for w in fleet]
    for turn, (
        (tokens, logits, n, cached),
        (ref_tokens, ref_logits, ref_n, ref_cached),
    ) in enumerate(zip(got, reference, strict=True)):
        assert n == ref_n and ref_cached == 0
        assert tokens == ref_tokens, f"turn {turn}: tokens differ"
        assert np.array_equal(logits, ref_logits), (
            f"turn {turn}: logits differ, max |d| {np.abs(logits - ref_logits).max()}"
        )
        if turn > 0:
            # everything before this turn's user text, less the last token fed back
            previous_prompt = got[turn - 1][2]
            assert cached >= previous_prompt + len(got[turn - 1][0]) - 1, (turn, cached)
    for b, a in zip(before, after, strict=True):
        assert a["dgr:prefix_cache_hits_total"] - b["dgr:prefix_cache_hits_total"] >= 2
        assert a["dgr:prefix_cache_sessions"] >= 1
        assert a["dgr:num_sessions_running"] == 0  # kept sessions hold no live slot


def test_a_restarted_stage_refuses_the_prefix_and_the_route_prefills_in_full(
    smollm2: Path,
) -> None:
    """A stage restart loses its cache and nothing else: the route's next turn asks for the
    prefix, the restarted stage refuses (FAILED_PRECONDITION), and the route prefills in full,
    the same bits as a route that never asks; the sessions the refused attempt opened on the
    other stages are gone."""
    from dgr_route.tokenizer import Tokenizer

    workers = _workers(smollm2, 1, {})
    try:
        tokenizer = Tokenizer(smollm2)
        addresses = [w.address for w in workers]
        describe = [
            pb_grpc.ShardServiceStub(grpc.insecure_channel(a)).Describe(  # type: ignore[no-untyped-call]
                pb.DescribeRequest(), timeout=10
            )
            for a in addresses
        ]
        assert [d.prefix_cache_sessions for d in describe] == [4, 4, 4]
        assert all(d.batch_invariant for d in describe)
        full = Route.open(addresses, timeout=120, prefix_reuse=False)
        reference = _conversation(full, tokenizer, 12)
        full.close()
        route = Route.open(addresses, timeout=120)
        history = tokenizer.encode(PROSE * 4) + list(tokenizer.vocab.tokenize(TURNS[0], False))
        list(route.generate(history, 12))  # turn 1: the stages keep it
        middle = workers[1]
        port = middle.port
        middle.stop()
        workers[1] = start_worker(
            smollm2,
            *LAYOUT[1],
            port=port,
            descriptor=descriptor_args(smollm2),
            threads=1,
            n_ctx=1024,
            extra=["--metrics-listen", "127.0.0.1:0"],
        )
        got = _conversation(route, tokenizer, 12)  # turn 1 again, then on
        route.close()
        assert [g[0] for g in got] == [r[0] for r in reference]
        assert all(np.array_equal(g[1], r[1]) for g, r in zip(got, reference, strict=True))
        # turn 1 asked for what the old middle kept: refused there, prefilled in full; the
        # turns after it reuse what the one before left on every stage
        assert got[0][3] == 0 and got[1][3] > 0 and got[2][3] > 0
        assert workers[1].metrics_json(timeout=5)["dgr:prefix_cache_misses_total"] >= 1
        deadline = time.monotonic() + 5  # the stages free their sessions as the streams end
        while any(w.sessions() for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(w.sessions() == 0 for w in workers)
    finally:
        for w in workers:
            w.stop()


def test_a_reused_session_fails_over_and_equals_full_prefills(smollm2: Path) -> None:
    """A turn that started from a kept prefix, its middle stage killed after 8 tokens: the
    session moves to a replacement route (a re-prefill of everything so far under a new epoch,
    no reuse there) and its tokens and logits are those of the conversation prefilled in full."""
    from dgr_route.route import RouteError
    from dgr_route.session import RouteSession
    from dgr_route.tokenizer import Tokenizer

    workers = _workers(smollm2, 1, {})
    spare: list[WorkerProcess] = []
    try:
        tokenizer = Tokenizer(smollm2)
        addresses = [w.address for w in workers]
        full = Route.open(addresses, timeout=120, prefix_reuse=False)
        reference = _conversation(full, tokenizer, 24)
        full.close()
        route = Route.open(addresses, timeout=10)
        history = tokenizer.encode(PROSE * 4) + list(tokenizer.vocab.tokenize(TURNS[0], False))
        turn1 = list(route.generate(history, 24))
        assert turn1 == reference[0][0]
        history = history + turn1 + list(tokenizer.vocab.tokenize(TURNS[1], False))

        def replace(err: RouteError) -> Route:
            spare.append(
                start_worker(
                    smollm2, *LAYOUT[1], descriptor=descriptor_args(smollm2), threads=1, n_ctx=1024
                )
            )
            return Route.open([addresses[0], spare[0].address, addresses[2]], timeout=30)

        session = RouteSession(route, Sampling(want_logits=True))
        tokens, logits = [], []
        for result in session.results(history, 24, replace=replace):
            tokens.append(int(result.token_id))
            logits.append(np.frombuffer(result.logits.payload, dtype=np.float32))
            if len(tokens) == 8:
                workers[1].kill()
        assert len(session.failures) == 1
        assert (
            workers[0].metrics_json(timeout=5)["dgr:prefix_cache_hits_total"] >= 1
        )  # turn 2 started reused
        assert tokens == reference[1][0]
        assert np.array_equal(np.stack(logits), reference[1][1])
    finally:
        for w in workers + spare:
            w.stop()


@pytest.mark.parametrize(
    "n", [40, pytest.param(1000, marks=pytest.mark.slow)], ids=lambda n: f"{n}-prompts"
)
def test_many_different_prompts_evict_by_lru_within_the_bytes_bound(smollm2: Path, n: int) -> None:
    """A client sending many different prompts (1,000 in the slow lane): the worker keeps at most
    what --prefix-cache-bytes allows (the most recent ones), counts what it evicted, and its RSS
    does not grow (the KV buffer was allocated whole at start); the most recent prompt still
    reuses."""
    bound = 2 << 20  # about 90 tokens of SmolLM2's KV
    worker = start_worker(
        smollm2,
        0,
        30,
        descriptor=descriptor_args(smollm2),
        threads=1,
        n_ctx=256,
        extra=["--metrics-listen", "127.0.0.1:0", "--prefix-cache-bytes", "2M"],
    )
    try:
        route = Route.open([worker.address], timeout=60)
        # each starts at another token (31 is prime to 5000): no two share a prefix
        prompts = [[1000 + (i * 7 + 31 * k) % 5000 for i in range(40)] for k in range(n)]
        rss = []
        for k, prompt in enumerate(prompts):
            list(route.generate(prompt, 4))
            m = worker.metrics_json(timeout=5)
            assert m["dgr:prefix_cache_bytes"] <= bound
            if k in (9, n - 1):
                rss.append(m["process_resident_memory_bytes"])
        m = worker.metrics_json(timeout=5)
        assert 1 <= m["dgr:prefix_cache_sessions"] <= 2
        assert m["dgr:prefix_cache_evictions_total"] >= n - 10
        print(f"{n} prompts: RSS {rss[0] >> 10} KiB after 10, {rss[1] >> 10} KiB after {n}")
        assert rss[1] - rss[0] < 4 << 20, f"RSS grew {(rss[1] - rss[0]) >> 10} KiB"
        usage = DraftUsage()
        list(route.results(prompts[-1] + [7, 8, 9], 2, usage=usage))
        assert usage.cached_tokens == 40  # all of the last prompt (its tokens differ after it)
        route.close()
    finally:
        worker.stop()
