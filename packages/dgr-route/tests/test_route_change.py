"""Route change on real workers (story DGR-047): a session that moves to another route, because
the caller switched it or because a stage died, bumps its epoch, re-prefills its tokens on the
new route (no KV moves) and goes on with the same greedy output as one process."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from dgr_cli.workers import WorkerProcess, descriptor_args, start_worker
from dgr_route.route import Route, RouteError
from dgr_route.session import RouteSession

N_TOKENS = 32


@pytest.fixture(scope="module")
def reference(smollm2: Path) -> tuple[list[int], list[int]]:
    from dgr_native.parity import reference_run

    prompt, _, tokens = reference_run(smollm2, N_TOKENS - 1)
    return prompt.tolist(), tokens


@pytest.fixture(scope="module")
def descriptor(smollm2: Path) -> list[str]:
    return descriptor_args(smollm2)


@pytest.fixture(scope="module")
def fleet(
    smollm2: Path, descriptor: list[str], worker_pool: Any
) -> dict[tuple[int, int], WorkerProcess]:
    ranges = [(0, 10), (10, 20), (20, 30), (0, 15), (15, 30)]
    return {r: worker_pool.get(smollm2, *r, descriptor=descriptor, n_ctx=512) for r in ranges}


def route(fleet: dict[tuple[int, int], WorkerProcess], layout: list[tuple[int, int]]) -> Route:
    return Route.open([fleet[r].address for r in layout], timeout=10)


def test_switching_routes_mid_generation_keeps_the_greedy_output(
    fleet: dict[tuple[int, int], WorkerProcess], reference: tuple[list[int], list[int]]
) -> None:
    prompt, expected = reference
    session = RouteSession(route(fleet, [(0, 10), (10, 20), (20, 30)]))
    two_stage = route(fleet, [(0, 15), (15, 30)])
    back = route(fleet, [(0, 10), (10, 20), (20, 30)])
    got = []
    for token in session.generate(prompt, N_TOKENS):
        got.append(token)
        if len(got) == 8:
            session.switch(two_stage)
        if len(got) == 20:
            session.switch(
                back
            )  # its stages held this session under epoch 1: dropped, re-prefilled
    assert got == expected
    assert session.epoch == 3 and session.route is back


def test_a_dead_stage_is_named_and_the_session_resumes_on_a_replacement(
    smollm2: Path,
    descriptor: list[str],
    fleet: dict[tuple[int, int], WorkerProcess],
    reference: tuple[list[int], list[int]],
) -> None:
    prompt, expected = reference
    doomed = start_worker(smollm2, 10, 20, descriptor=descriptor, n_ctx=512)
    replacement: list[WorkerProcess] = []
    started = time.monotonic()
    noticed: list[float] = []

    def replace(err: RouteError) -> Route:
        noticed.append(time.monotonic() - started)
        layers = session.route.stages[err.stage].layers
        lo, hi = layers.first, layers.last
        replacement.append(start_worker(smollm2, lo, hi, descriptor=descriptor, n_ctx=512))
        addresses = [s.address for s in session.route.stages]
        addresses[err.stage] = replacement[0].address
        return Route.open(addresses, timeout=10)

    first = Route.open(
        [fleet[(0, 10)].address, doomed.address, fleet[(20, 30)].address], timeout=10
    )
    session = RouteSession(first)
    got = []
    try:
        for token in session.generate(prompt, N_TOKENS, replace=replace):
            got.append(token)
            if len(got) == 5:
                doomed.kill()
                started = time.monotonic()
    finally:
        doomed.stop()
        for w in replacement:
            w.stop()
    assert got == expected
    [failure] = session.failures
    assert failure.stage == 1 and failure.address == doomed.address
    assert noticed[0] < 15
    assert session.epoch == 2


def test_without_a_replacement_the_failure_surfaces(
    smollm2: Path,
    descriptor: list[str],
    fleet: dict[tuple[int, int], WorkerProcess],
    reference: tuple[list[int], list[int]],
) -> None:
    prompt, _ = reference
    doomed = start_worker(smollm2, 15, 30, descriptor=descriptor, n_ctx=512)
    session = RouteSession(Route.open([fleet[(0, 15)].address, doomed.address], timeout=10))
    stream = session.generate(prompt, N_TOKENS, replace=lambda err: None)
    next(stream)
    doomed.kill()
    with pytest.raises(RouteError) as info:
        list(stream)
    assert info.value.stage == 1 and doomed.address in str(info.value)
    doomed.stop()


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant-kernels", "stock-kernels"])
def test_replay_batches_equal_decode_steps(
    engine_module: Any, smollm2: Path, invariant: bool
) -> None:
    """What makes a re-prefill exact: generated tokens fed back in batches of REPLAY_BATCH give
    every logits row bit for bit as the decode steps that produced them did. With the engine's
    batch-invariant kernels (the default) a history batched whole does too; with ggml's stock
    kernels it does not (the threshold is pinned from both sides)."""
    import numpy as np
    from dgr_route.route import REPLAY_BATCH

    engine = engine_module.Engine(
        str(smollm2), n_threads=2, n_ctx=512, max_sessions=2, batch_invariant=invariant
    )
    prompt = np.array([1000 + (i * 7) % 5000 for i in range(40)], dtype=np.int32)
    n_gen = 2 * REPLAY_BATCH + 8
    step = engine.forward(1, 1, 0, tokens=prompt)[-1]
    tokens, rows = [], []
    for i in range(n_gen):
        tokens.append(int(np.argmax(step)))
        step = engine.forward(1, 1, 40 + i, tokens=np.array(tokens[-1:], dtype=np.int32))[-1]
        rows.append(step)

    def replayed(batch: int) -> np.ndarray:
        engine.forward(2, 1, 0, tokens=prompt)
        out = []
        for start in range(0, n_gen, batch):
            part = np.array(tokens[start : start + batch], dtype=np.int32)
            out.append(engine.forward(2, 1, 40 + start, tokens=part, logits_all=True))
        engine.release(2)
        return np.concatenate(out)

    exact = replayed(REPLAY_BATCH)
    assert np.array_equal(exact.view(np.uint32), np.stack(rows).view(np.uint32))
    whole = replayed(n_gen)  # 72 tokens at once: the stock kernels tile them, other bits
    same = np.array_equal(whole.view(np.uint32), np.stack(rows).view(np.uint32))
    assert same == invariant


def test_a_long_history_resumes_exactly_after_a_stage_dies(
    smollm2: Path, descriptor: list[str], fleet: dict[tuple[int, int], WorkerProcess]
) -> None:
    """The reliability issue's case: the middle stage killed after 50 generated tokens; the
    re-prefill of a 50+-token history on the replacement must not change the continuation."""
    from dgr_native.parity import reference_run

    prompt, _, expected = reference_run(smollm2, 199)
    doomed = start_worker(smollm2, 10, 20, descriptor=descriptor, n_ctx=512)
    spare: list[WorkerProcess] = []

    def replace(err: RouteError) -> Route:
        spare.append(start_worker(smollm2, 10, 20, descriptor=descriptor, n_ctx=512))
        return Route.open(
            [fleet[(0, 10)].address, spare[0].address, fleet[(20, 30)].address], timeout=10
        )

    route = Route.open(
        [fleet[(0, 10)].address, doomed.address, fleet[(20, 30)].address], timeout=10
    )
    session = RouteSession(route)
    got = []
    try:
        for token in session.generate(prompt.tolist(), 200, replace=replace):
            got.append(token)
            if len(got) == 50:
                doomed.kill()
    finally:
        doomed.stop()
        for w in spare:
            w.stop()
    assert len(session.failures) == 1
    assert got == expected


@pytest.mark.parametrize("mode", ["forward", "relay"])
def test_a_worker_restarted_with_another_range_refuses_instead_of_computing(
    smollm2: Path, descriptor: list[str], reference: tuple[list[int], list[int]], mode: str
) -> None:
    """The tail [15, 30) restarted behind the same address as [20, 30): an open route (dgr serve
    keeps one) went on generating through it, layers 15-19 skipped, text from a wrong model and
    no error. Every request now carries what the route found each stage serving (the head's
    from the coordinator, each next one's from RouteSpec.expect): the changed stage refuses
    with FAILED_PRECONDITION naming both ranges, and the route reopened on it says the layers
    do not follow (a gap)."""
    prompt, expected = reference
    head = start_worker(smollm2, 0, 15, descriptor=descriptor, n_ctx=512)
    tail = start_worker(smollm2, 15, 30, descriptor=descriptor, n_ctx=512)
    other = None
    try:
        r = Route.open([head.address, tail.address], timeout=10, mode=mode)
        assert list(r.generate(prompt, 4)) == expected[:4]
        port = tail.port
        tail.stop()
        other = start_worker(smollm2, 20, 30, descriptor=descriptor, n_ctx=512, port=port)
        with pytest.raises(RouteError) as refused:
            list(r.generate(prompt, 4))
        assert refused.value.stage == 1 and refused.value.address == other.address
        assert (
            "stage changed: the route expects layers [15, 30) of model "
            f"{descriptor_fingerprint(descriptor)[:16]}, this worker serves [20, 30)"
        ) in str(refused.value), refused.value
        r.close()
        with pytest.raises(RouteError, match=r"layer range \[20, 30\) leaves a gap"):
            Route.open([head.address, other.address], timeout=10, mode=mode)
    finally:
        for w in (head, tail, other):
            if w is not None:
                w.stop()


def descriptor_fingerprint(descriptor: list[str]) -> str:
    return descriptor[descriptor.index("--model-fingerprint") + 1]
