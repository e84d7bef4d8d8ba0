"""Many sessions through the same workers (story DGR-048): concurrent sessions each produce what
they produce alone, a full queue answers RESOURCE_EXHAUSTED instead of growing, and the worker
keeps serving after refusing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from dgr_cli.workers import WorkerProcess, descriptor_args, start_worker
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
def fleet(smollm2: Path, descriptor: list[str]) -> Iterator[list[WorkerProcess]]:
    workers = [start_worker(smollm2, a, b, descriptor=descriptor, n_ctx=512) for a, b in LAYOUT]
    yield workers
    for w in workers:
        w.stop()


def test_concurrent_sessions_each_give_their_own_output(
    engine_module: object, smollm2: Path, fleet: list[WorkerProcess]
) -> None:
    from dgr_route.tokenizer import Tokenizer

    tokenizer = Tokenizer(smollm2)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    route = Route.open([w.address for w in fleet], timeout=60)
    alone = [list(route.generate(p, 16)) for p in prompts]
    together: list[list[int]] = [[] for _ in prompts]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            together[i] = list(route.generate(prompts[i], 16))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    route.close()
    assert errors == []
    assert together == alone
    assert len({tuple(a) for a in alone}) == len(alone)  # the sessions really differ


def test_a_full_queue_is_resource_exhausted_and_the_worker_keeps_serving(
    smollm2: Path, descriptor: list[str]
) -> None:
    whole = start_worker(
        smollm2, 0, 30, descriptor=descriptor, n_ctx=1024, extra=["--max-queue", "0"]
    )
    try:
        route = Route.open([whole.address], timeout=60)
        prompts = [[1000 + (i * 7 + k) % 5000 for i in range(500)] for k in range(4)]
        start = threading.Barrier(len(prompts))
        served: list[int] = []
        refused: list[RouteError] = []

        def run(prompt: list[int]) -> None:
            start.wait()
            try:
                served.extend(route.generate(prompt, 1))
            except RouteError as err:
                refused.append(err)

        threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
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
    engine_module: object, smollm2: Path, fleet: list[WorkerProcess]
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
    together: list[list[tuple[int, np.ndarray]]] = [[] for _ in prompts]
    start = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        start.wait()
        together[i] = list(route.trace(prompts[i], steps))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
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
