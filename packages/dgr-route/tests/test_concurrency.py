"""Many sessions through the same workers (story DGR-048): concurrent sessions each produce what
they produce alone, a full queue answers RESOURCE_EXHAUSTED instead of growing, and the worker
keeps serving after refusing."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from dgr_cli.workers import WorkerProcess, descriptor_args, start_stages, start_worker
from dgr_route.route import Route, RouteError

LAYOUT = [(0, 10), (10, 20), (20, 30)]
PROMPTS = [
    "The three primary colors are",
    "A good recipe for bread needs",
    "The capital of Japan is",
    "Distributed systems fail when",
]


@pytest.fixture(scope="module")
def descriptor(smollm2: Path) -> list[str]:
    return descriptor_args(smollm2)


@pytest.fixture(scope="module")
def fleet(smollm2: Path, descriptor: list[str], worker_pool: Any) -> list[WorkerProcess]:
    return [worker_pool.get(smollm2, a, b, descriptor=descriptor, n_ctx=512) for a, b in LAYOUT]


def test_concurrent_sessions_each_give_their_own_output(
    engine_module: object,
    smollm2: Path,
    fleet: list[WorkerProcess],
    concurrently: Callable[..., list[Any]],
) -> None:
    from dgr_route.tokenizer import Tokenizer

    tokenizer = Tokenizer(smollm2)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    route = Route.open([w.address for w in fleet], timeout=60)
    alone = [list(route.generate(p, 16)) for p in prompts]
    together = concurrently(lambda i: list(route.generate(prompts[i], 16)), len(prompts), 120)
    route.close()
    assert together == alone
    assert len({tuple(a) for a in alone}) == len(alone)  # the sessions really differ


def test_a_full_queue_is_resource_exhausted_and_the_worker_keeps_serving(
    smollm2: Path, descriptor: list[str], concurrently: Callable[..., list[Any]]
) -> None:
    whole = start_worker(
        smollm2, 0, 30, descriptor=descriptor, n_ctx=1024, extra=["--max-queue", "0"]
    )
    try:
        route = Route.open([whole.address], timeout=60)
        prompts = [[1000 + (i * 7 + k) % 5000 for i in range(500)] for k in range(4)]
        served: list[int] = []
        refused: list[RouteError] = []

        def run(i: int) -> None:
            try:
                served.extend(route.generate(prompts[i], 1))
            except RouteError as err:
                refused.append(err)

        concurrently(run, len(prompts), 120)
        # one prefill computes at a time and none may wait: simultaneous arrivals are refused
        assert served and refused
        assert len(served) + len(refused) == len(prompts)
        for err in refused:
            assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in err.what
        assert len(list(route.generate(prompts[0], 2))) == 2  # and served once it drained
        route.close()
    finally:
        whole.stop()


def test_session_slots_are_bounded(smollm2: Path, descriptor: list[str]) -> None:
    whole = start_worker(smollm2, 0, 30, descriptor=descriptor, n_ctx=256, max_sessions=2)
    try:
        route = Route.open([whole.address], timeout=60)
        held = [route.generate([1, 2, 3], 8) for _ in range(2)]
        for stream in held:
            next(stream)  # each holds a slot while its stream stays open
        with pytest.raises(RouteError) as info:
            next(route.generate([4, 5, 6], 8))
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "session slots" in info.value.what
        for stream in held:
            stream.close()
        assert len(list(route.generate([4, 5, 6], 2))) == 2
        route.close()
    finally:
        whole.stop()


def test_batched_sessions_equal_their_solo_logits(
    engine_module: object,
    smollm2: Path,
    fleet: list[WorkerProcess],
    concurrently: Callable[..., list[Any]],
) -> None:
    """Decode steps of sessions that wait at a stage together are computed in one llama_decode;
    each session's logits still equal its solo run bit for bit (the largest difference is 0)."""
    import numpy as np
    from dgr.v1 import shard_pb2 as pb
    from dgr.v1 import shard_pb2_grpc as pb_grpc
    from dgr_route.tokenizer import Tokenizer

    tokenizer = Tokenizer(smollm2)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    route = Route.open([w.address for w in fleet], timeout=60)
    steps = 24
    alone = [list(route.trace(p, steps)) for p in prompts]
    together = concurrently(lambda i: list(route.trace(prompts[i], steps)), len(prompts))
    route.close()
    widest = [
        pb_grpc.ShardServiceStub(grpc.insecure_channel(w.address))
        .Health(pb.HealthRequest(), timeout=10)
        .widest_batch
        for w in fleet
    ]
    assert max(widest) >= 2, f"no stage ever batched: {widest}"
    worst = 0.0
    for a, b in zip(alone, together, strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        worst = max(
            worst, max(float(np.max(np.abs(x - y))) for (_, x), (_, y) in zip(a, b, strict=True))
        )
    assert worst == 0.0


def test_a_convoy_of_sessions_stays_one_batch_around_the_ring(
    engine_module: object,
    smollm2: Path,
    descriptor: list[str],
    concurrently: Callable[..., list[Any]],
) -> None:
    """Forward mode: the decode steps a stage computes together reach the next stage one by one,
    each on its own session's stream, as a cohort; the next stage waits for the whole cohort
    (its gather window, generous here) instead of computing the first arrival alone, and the head
    waits for the sessions whose tokens follow close behind, so sessions started together form
    one convoy. No stage computes more llama_decodes than the stage before it, greedy output
    equals each session's solo run, and a session that ends (shorter max_tokens) lets its
    cohort-mates go on at once: no gather ever runs out its window."""
    from dgr_route.tokenizer import Tokenizer

    workers = start_stages(
        smollm2,
        LAYOUT,
        n_ctx=512,
        max_sessions=4,
        extra=["--gather-us", "200000", "--metrics-listen", "127.0.0.1:0"],
    )
    try:
        tokenizer = Tokenizer(smollm2)
        prompts = [tokenizer.encode(p) for p in PROMPTS]
        lengths = [12, 16, 20, 24]
        route = Route.open([w.address for w in workers], timeout=60)
        alone = [list(route.generate(p, n)) for p, n in zip(prompts, lengths, strict=True)]
        before = [w.metrics_json() for w in workers]
        t0 = time.monotonic()
        together = concurrently(
            lambda i: list(route.generate(prompts[i], lengths[i])), len(prompts)
        )
        elapsed = time.monotonic() - t0
        route.close()
        after = [w.metrics_json() for w in workers]
    finally:
        for w in workers:
            w.stop()
    assert together == alone
    turns = [
        int(a["dgr:batch_width"]["count"]) - int(b["dgr:batch_width"]["count"])  # type: ignore[index]
        for a, b in zip(after, before, strict=True)
    ]
    widths = [
        (float(a["dgr:batch_width"]["sum"]) - float(b["dgr:batch_width"]["sum"]))  # type: ignore[index]
        for a, b in zip(after, before, strict=True)
    ]
    assert widths == [float(sum(lengths))] * 3, widths
    # every forward of the 4 sessions at each stage (prefills and decode steps), and the
    # llama_decodes they took. One convoy takes a turn per prefill and one per decode step of
    # the longest session: 4 + 23 = 27 (measured: 27 at every stage, every run). Computing each
    # cohort's first arrival alone (no gathering) split it at every stage, 50-56 turns; keeping
    # cohorts together without forming them at the head, 31-32
    assert turns[1] <= turns[0] and turns[2] <= turns[1], f"a cohort split: turns per stage {turns}"
    one_convoy = len(prompts) + max(lengths) - 1
    assert all(t <= one_convoy + 2 for t in turns), (
        f"no single convoy: {turns} turns per stage for {widths} forwards ({one_convoy} if one)"
    )
    timeouts = [a["dgr:cohort_gather_timeouts_total"] for a in after]
    assert timeouts == [0, 0, 0], f"a gather ran out its window: {timeouts}"
    assert elapsed < 60


def test_the_head_keeps_a_convoy_on_loopback_and_sends_sessions_apart_behind_long_links(
    engine_module: object, smollm2: Path, concurrently: Callable[..., list[Any]]
) -> None:
    """The head's convoy rule (native/worker/convoy.h) on real workers: each token comes back
    with the stages' time for its step, and the head compares its round trip with it. On
    loopback the links are a sliver of the round and the sessions stay one convoy; behind
    dgr-netsim links of 10 ms each way (three hops around the ring) the links are most of it and
    the head sends its sessions apart. Each route has a rule of its own, and either way every
    session's greedy tokens are its solo run's."""
    from dgr_bench.bench_wan import linked
    from dgr_route.tokenizer import Tokenizer

    tokenizer = Tokenizer(smollm2)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    workers = start_stages(
        smollm2, LAYOUT, n_ctx=512, max_sessions=4, extra=["--metrics-listen", "127.0.0.1:0"]
    )
    try:
        direct = [w.address for w in workers]
        route = Route.open(direct, timeout=60)
        alone = [list(route.generate(p, 24)) for p in prompts]
        near = concurrently(lambda i: list(route.generate(prompts[i], 24)), len(prompts), 120)
        route.close()
        on_loopback = workers[0].metrics_json()
        with linked(direct, 10) as addresses:
            far_route = Route.open(addresses, timeout=60, peers=addresses)
            far = concurrently(
                lambda i: list(far_route.generate(prompts[i], 24)), len(prompts), 120
            )
            far_route.close()
            behind_links = workers[0].metrics_json()
    finally:
        for w in workers:
            w.stop()
    assert near == alone
    assert far == alone
    link, compute = "dgr:head_route_link_seconds", "dgr:head_route_compute_seconds"
    assert on_loopback["dgr:head_sessions_apart"] == 0, on_loopback
    assert on_loopback[link] < 0.25 * on_loopback[compute], on_loopback
    assert behind_links["dgr:head_sessions_apart"] == 1, behind_links
    # three one-way hops of 10 ms: the head to stage 1, stage 1 to 2, the tail back to the head
    assert 0.029 <= behind_links[link] < 0.2, behind_links
    assert 0 < behind_links[compute] < behind_links[link], behind_links
