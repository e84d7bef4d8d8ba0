"""Live workers for the tracker-input tests: a 2-stage SmolLM2 route with metrics served."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from dgr_route.workers import WorkerProcess, descriptor_args, start_worker

N_CTX = 128
MAX_SESSIONS = 2


@pytest.fixture(scope="package")
def workers(smollm2: Path) -> Iterator[list[WorkerProcess]]:
    descriptor = descriptor_args(smollm2)
    started = [
        start_worker(
            smollm2,
            a,
            b,
            descriptor=descriptor,
            n_ctx=N_CTX,
            max_sessions=MAX_SESSIONS,
            extra=["--metrics-listen", "127.0.0.1:0"],
        )
        for a, b in [(0, 15), (15, 30)]
    ]
    yield started
    for w in started:
        w.stop()


@pytest.fixture(scope="package")
def limits() -> tuple[int, int]:
    """(n_ctx per session, max_sessions) the workers were started with."""
    return N_CTX, MAX_SESSIONS
