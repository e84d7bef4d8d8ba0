"""Prefix reuse across generations (issue 47): each stage keeps finished sessions' KV, a new
generation whose prompt starts with a kept history computes only the rest, and the result is the
same bits as a full prefill; a stage that lost the entry refuses and the route prefills from 0.

Real workers, a 3-stage SmolLM2 route, contexts past 300 tokens (short prompts hide the kernel
differences that made a suffix prefilled after a reused prefix differ from a full prefill)."""

from __future__ import annotations

import json
import urllib.request
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


def _metrics(worker: WorkerProcess) -> dict[str, float]:
    assert worker.metrics_url
    with urllib.request.urlopen(worker.metrics_url + "/metrics.json", timeout=5) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def test_a_conversation_reusing_its_prefix_equals_full_prefills_bitwise(
    smollm2: Path, fleet: list[WorkerProcess]
) -> None:
    from dgr_route.tokenizer import Tokenizer

    tokenizer = Tokenizer(smollm2)
    addresses = [w.address for w in fleet]
    full = Route.open(addresses, timeout=120, prefix_reuse=False)
    reference = _conversation(full, tokenizer)
    full.close()
    before = [_metrics(w) for w in fleet]
    reused = Route.open(addresses, timeout=120)
    got = _conversation(reused, tokenizer)
    reused.close()
    after = [_metrics(w) for w in fleet]
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


def test_a_stage_without_the_prefix_refuses_and_the_route_prefills_in_full(
    smollm2: Path,
) -> None:
    from dgr_route.tokenizer import Tokenizer

    # the middle stage keeps nothing: every reuse the route asks for is refused there
    workers = _workers(smollm2, 1, {1: ["--prefix-cache-sessions", "0"]})
    try:
        tokenizer = Tokenizer(smollm2)
        addresses = [w.address for w in workers]
        describe = [
            pb_grpc.ShardServiceStub(grpc.insecure_channel(a)).Describe(  # type: ignore[no-untyped-call]
                pb.DescribeRequest(), timeout=10
            )
            for a in addresses
        ]
        assert [d.prefix_cache_sessions for d in describe] == [4, 0, 4]
        assert all(d.batch_invariant for d in describe)
        full = Route.open(addresses, timeout=120, prefix_reuse=False)
        reference = _conversation(full, tokenizer, 12)
        full.close()
        route = Route.open(addresses, timeout=120)
        got = _conversation(route, tokenizer, 12)
        route.close()
        assert [g[0] for g in got] == [r[0] for r in reference]
        assert all(np.array_equal(g[1], r[1]) for g, r in zip(got, reference, strict=True))
        assert [g[3] for g in got] == [0, 0, 0]  # refused, so nothing counted as cached
        middle = _metrics(workers[1])
        assert middle["dgr:prefix_cache_misses_total"] >= 2
        assert middle["dgr:prefix_cache_sessions"] == 0
        assert all(w.sessions() == 0 for w in workers)  # the refused sessions hold nothing
    finally:
        for w in workers:
            w.stop()
