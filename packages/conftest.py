"""Fixtures shared by every package's tests: the real SmolLM2 from the package index and the
real ShardEngine module (built on first use)."""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow", action="store_true", help="run the tests marked slow too (nox -s tests-slow)"
    )


# What starts a fleet of worker processes: the launcher and the commands and helpers built on it.
# A test whose module names one of them, or that takes a fixture that starts workers, is marked
# `fleet`; `./dev check` (nox -s check) runs the rest: the tests that start no worker process.
FLEET_NAMES = re.compile(
    r"\b(start_worker|start_stages|behind_links|run_demo|metered_workers)\b"
    r"|[\[(]\s*(?:DGR|dgr|\w+)\s*,\s*\"(?:worker|demo|serve|generate|chat)\""
)
FLEET_FIXTURES = {"metered_workers", "worker_pool"}


@functools.cache
def _starts_fleets(path: str) -> bool:
    return bool(FLEET_NAMES.search(Path(path).read_text(encoding="utf-8")))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that start worker processes are marked `fleet` (the fast tier leaves them out);
    tests marked slow are skipped unless --slow: the README's test command stays fast."""
    fleet = pytest.mark.fleet
    for item in items:
        module = getattr(item, "module", None)
        path = getattr(module, "__file__", None)
        uses = set(getattr(item, "fixturenames", ()))
        if (path and _starts_fleets(path)) or uses & FLEET_FIXTURES:
            item.add_marker(fleet)
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow (nox -s tests-slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from dgr_artifacts.models import model_path

    return model_path()


@pytest.fixture(scope="session")
def engine_module() -> ModuleType:
    from dgr_native import load

    return load()


@pytest.fixture(scope="session")
def quick_twin() -> Path:
    """The generated DeepSeek V4 quick twin (6 main layers + MTP, hc = 4, 3 hash-routed layers)."""
    from dgr_native.twins import QUICK, twin_path

    return twin_path(QUICK)


class WorkerPool:
    """Workers shared by every test of the session that asks for the same model, range and
    options (`start_worker`'s, defaults filled in): started on first use, stopped when the
    session ends. For tests that route through workers and leave them as they found them; a
    test that stops, kills, suspends or restarts a worker starts its own."""

    def __init__(self) -> None:
        self._workers: dict[tuple[Any, ...], Any] = {}
        self._lock = threading.Lock()

    def get(self, model: Path, first: int, last: int, **options: Any) -> Any:
        import inspect

        from dgr_cli.workers import start_worker

        bound = inspect.signature(start_worker).bind(model, first, last, **options)
        bound.apply_defaults()
        key = tuple(
            (name, tuple(v) if isinstance(v, list) else str(v) if isinstance(v, Path) else v)
            for name, v in bound.arguments.items()
        )
        with self._lock:
            worker = self._workers.get(key)
            if worker is None or worker.proc.poll() is not None:
                worker = self._workers[key] = start_worker(model, first, last, **options)
            return worker

    def close(self) -> None:
        for worker in self._workers.values():
            worker.stop()
        self._workers.clear()


@pytest.fixture(scope="session")
def worker_pool() -> Iterator[WorkerPool]:
    """The session's shared workers (`WorkerPool`)."""
    pool = WorkerPool()
    yield pool
    pool.close()


METERED_N_CTX, METERED_MAX_SESSIONS = 128, 2


@pytest.fixture(scope="session")
def metered_limits() -> tuple[int, int]:
    """(n_ctx per session, max_sessions) of `metered_workers`."""
    return METERED_N_CTX, METERED_MAX_SESSIONS


@pytest.fixture(scope="module")
def metered_workers(smollm2: Path) -> Iterator[list[Any]]:
    """A 2-stage SmolLM2 route, [0, 15) and [15, 30), whose workers serve their metrics
    (--metrics-listen on a free port) with `metered_limits`."""
    from dgr_cli.workers import descriptor_args, start_worker

    descriptor = descriptor_args(smollm2)
    started = [
        start_worker(
            smollm2,
            a,
            b,
            descriptor=descriptor,
            n_ctx=METERED_N_CTX,
            max_sessions=METERED_MAX_SESSIONS,
            extra=["--metrics-listen", "127.0.0.1:0"],
        )
        for a, b in [(0, 15), (15, 30)]
    ]
    yield started
    for w in started:
        w.stop()


def _concurrently(fn: Callable[[int], Any], n: int, timeout: float = 180.0) -> list[Any]:
    """fn(0) .. fn(n - 1) in n threads released together (a barrier, so they reach the route at
    once): their results in order. The first exception a thread raised is raised here, and a
    thread still running after `timeout` fails the test (a hang, not a slow pass)."""
    results: list[Any] = [None] * n
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def run(i: int) -> None:
        try:
            start.wait()
            results[i] = fn(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    hung = sum(t.is_alive() for t in threads)
    assert hung == 0, f"{hung} of {n} concurrent calls still running after {timeout} s"
    if errors:
        raise errors[0]
    return results


@pytest.fixture(scope="session")
def concurrently() -> Callable[..., list[Any]]:
    """Run calls in threads released together (see `_concurrently`)."""
    return _concurrently
