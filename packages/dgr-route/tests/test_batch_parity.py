"""Batching is exact at every thread count (issue 47): sessions whose decode steps a stage
computes in one llama_decode each get exactly what they get alone, tokens and f32 logits, at 1,
2 and 4 threads per worker. With ggml's stock kernels a 337-token session batched with others
differed from its solo run at 2 threads from the first decode step (a lone query row's KV is
split across threads, a batch's rows are not); the engine's batch-invariant kernels (patch
0007) compute every row alike."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from dgr.v1 import shard_pb2 as pb
from dgr.v1 import shard_pb2_grpc as pb_grpc
from dgr_cli.workers import descriptor_args, start_worker
from dgr_route.route import Route, Sampling

LAYOUT = [(0, 10), (10, 20), (20, 30)]
N_TOKENS = 96
PROSE = (
    "In the archive under the observatory, the astronomers kept every plate they had ever "
    "exposed: glass squares in paper sleeves, each one a night of the sky as it was, stars "
    "fixed in silver. A visiting student once asked why they did not simply scan them and "
    "throw the glass away, and the oldest of them laughed and said that the glass remembered "
    "things the scans did not, small flaws and dust and the breath of whoever held it last. "
)


def _prompts(smollm2: Path) -> list[list[int]]:
    from dgr_route.tokenizer import Tokenizer

    tokenizer = Tokenizer(smollm2)
    prose = tokenizer.encode(PROSE * 6)[:337]
    chat = tokenizer.encode(
        tokenizer.chat([("system", "You are terse."), ("user", "Name three rivers in Europe.")])
    )
    return [prose, chat, [int(tokenizer.encode("Once")[-1])]]


# 12 compute threads on 2 cores decode at ~3.3 s a token (ggml's barriers wait out scheduler
# slices): the 4-thread run takes fewer tokens, the prompts (337 tokens the longest) the same
TOKENS_AT = {4: 24}


def _trace(
    route: Route, prompt: list[int], n_tokens: int = N_TOKENS
) -> tuple[list[int], np.ndarray]:
    tokens, logits = [], []
    for result in route.results(prompt, n_tokens, Sampling(want_logits=True)):
        tokens.append(int(result.token_id))
        logits.append(np.frombuffer(result.logits.payload, dtype=np.float32))
    return tokens, np.stack(logits)


@pytest.mark.parametrize(
    "threads", [1, 2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda t: f"{t}-threads"
)
def test_sessions_batched_together_equal_their_solo_runs_bitwise(
    smollm2: Path, threads: int, concurrently: Callable[..., list[Any]]
) -> None:
    prompts = _prompts(smollm2)
    assert len(prompts[0]) == 337 and len(prompts[2]) == 1
    descriptor = descriptor_args(smollm2)
    workers = [
        start_worker(smollm2, a, b, descriptor=descriptor, threads=threads, n_ctx=512)
        for a, b in LAYOUT
    ]
    try:
        # no prefix reuse: the solo runs and the batched ones each prefill in full
        route = Route.open([w.address for w in workers], timeout=300, prefix_reuse=False)
        n = TOKENS_AT.get(threads, N_TOKENS)
        solo = [_trace(route, p, n) for p in prompts]
        together = concurrently(lambda i: _trace(route, prompts[i], n), len(prompts), 900)
        route.close()
        widest = [
            pb_grpc.ShardServiceStub(grpc.insecure_channel(w.address))  # type: ignore[no-untyped-call]
            .Health(pb.HealthRequest(), timeout=10)
            .widest_batch
            for w in workers
        ]
        assert max(widest) >= 2, f"no stage batched the sessions (widest batch {widest})"
        for i, ((tokens, logits), (ref_tokens, ref_logits)) in enumerate(
            zip(together, solo, strict=True)
        ):
            assert tokens == ref_tokens, (
                f"prompt {i}: tokens part at {_first_diff(tokens, ref_tokens)}"
            )
            assert np.array_equal(logits, ref_logits), (
                f"prompt {i}: logits differ (max |d| {np.abs(logits - ref_logits).max()})"
            )
    finally:
        for w in workers:
            w.stop()


@pytest.mark.parametrize("threads", [1, 2], ids=lambda t: f"{t}-threads")
def test_sessions_sent_apart_behind_long_links_equal_their_solo_runs_bitwise(
    smollm2: Path, threads: int, concurrently: Callable[..., list[Any]]
) -> None:
    """Behind 10 ms links the head sends concurrent sessions apart (native/worker/convoy.h):
    their steps meet at the stages in whatever groups they arrive in, and each still gets its
    solo run's tokens and f32 logits."""
    from dgr_bench.bench_wan import linked

    prompts = _prompts(smollm2)
    descriptor = descriptor_args(smollm2)
    workers = [
        start_worker(
            smollm2,
            a,
            b,
            descriptor=descriptor,
            threads=threads,
            n_ctx=512,
            extra=["--metrics-listen", "127.0.0.1:0"],
        )
        for a, b in LAYOUT
    ]
    try:
        with linked([w.address for w in workers], 10) as addresses:
            route = Route.open(addresses, timeout=300, peers=addresses, prefix_reuse=False)
            solo = [_trace(route, p) for p in prompts]
            together = concurrently(lambda i: _trace(route, prompts[i]), len(prompts), 600)
            route.close()
        head = workers[0].metrics_json()
    finally:
        for w in workers:
            w.stop()
    assert head["dgr:head_sessions_apart"] == 1, head
    for i, ((tokens, logits), (ref_tokens, ref_logits)) in enumerate(
        zip(together, solo, strict=True)
    ):
        assert tokens == ref_tokens, f"prompt {i}: tokens part at {_first_diff(tokens, ref_tokens)}"
        assert np.array_equal(logits, ref_logits), (
            f"prompt {i}: logits differ (max |d| {np.abs(logits - ref_logits).max()})"
        )


def _first_diff(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
