"""A worker's compute pool wakes as each forward starts and polls for its graph while the
handler builds it (`--poll`, 50 by default: a 2-thread graph then never waits at its first
barrier for a thread waking on another core), and sleeps again when the forward ends: an idle
stage takes no CPU from the stage computing beside it."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from dgr_cli.workers import WorkerProcess, descriptor_args, start_worker
from dgr_route.route import Route

PROMPT = list(range(1000, 1012))


def cpu_ns(worker: WorkerProcess) -> int:
    """Nanoseconds all the worker's threads have run (/proc/PID/task/TID/schedstat)."""
    total = 0
    for stat in Path(f"/proc/{worker.proc.pid}/task").glob("*/schedstat"):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that ended
            total += int(stat.read_text().split()[0])
    return total


def test_a_polling_pool_sleeps_once_its_forward_is_done(smollm2: Path) -> None:
    # the highest spin level: a pool left awake would poll for 1024 x 128 x 100 rounds after the
    # last forward (0.3 s on this machine's EPYC), far over what an idle worker takes
    worker = start_worker(
        smollm2,
        0,
        30,
        descriptor=descriptor_args(smollm2),
        threads=2,
        n_ctx=128,
        extra=["--poll", "100"],
    )
    try:
        route = Route.open([worker.address], timeout=60)
        assert len(list(route.generate(PROMPT, 8))) == 8
        before = cpu_ns(worker)
        time.sleep(0.5)
        idle_ms = (cpu_ns(worker) - before) / 1e6
        route.close()
        assert idle_ms < 20, f"the worker ran {idle_ms:.1f} ms in 0.5 s after its last forward"
    finally:
        worker.stop()
