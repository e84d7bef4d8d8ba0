"""Workers' compute threads take a realtime priority where the process may (`--prio auto`,
opt-in: the default is normal priority), so that nothing else on the host preempts a graph whose
threads spin at its barriers; a graph that got no compute slot computes at normal priority
instead, on a pool of its own, and gives the same output (equal-priority realtime threads of two
graphs on too few cores could stall each other for good)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from dgr_cli.workers import WorkerProcess, descriptor_args, start_worker
from dgr_route.route import Route

# A `--prio auto` worker on this 2-core VM sometimes printed nothing for minutes after its start
# (about one fresh-clone CI run in three; here 1 start in 5-20). Stop 60 found why, with gdb: a
# compute pool made by a handler pinned to one core at SCHED_FIFO had its thread inherit both;
# it waited on that core behind its maker, which spun at that priority in the graph's first
# barrier waiting for it. Pools are now made from the process's cores at SCHED_OTHER (PoolMaker,
# native/engine/src/engine.h): 60 starts and 10 runs of these tests since, none stalled. Back in
# the default lane (they were `slow` while the cause was unknown).


PROMPT = list(range(1000, 1012))
SCHED_FIFO = 1


def realtime_allowed() -> bool:
    """What the worker's own probe finds: may a thread of this user take SCHED_FIFO?"""
    probe = "import os; os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(40))"
    return subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0


def policies(worker: WorkerProcess) -> dict[int, int]:
    """Each thread's scheduling policy by thread id (/proc/PID/task/TID/stat, field 41)."""
    out = {}
    for stat in Path(f"/proc/{worker.proc.pid}/task").glob("*/stat"):
        fields = stat.read_text().rsplit(")", 1)[1].split()
        out[int(stat.parent.name)] = int(fields[38])  # fields[0] is field 3
    return out


def fifo_threads(worker: WorkerProcess) -> int:
    """Threads of the worker whose scheduling policy is SCHED_FIFO."""
    return sum(p == SCHED_FIFO for p in policies(worker).values())


def without_slot(worker: WorkerProcess) -> float:
    """The worker's count of forwards computed without a compute slot (/metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    assert worker.metrics_url is not None
    with urllib.request.urlopen(f"{worker.metrics_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "dgr:forwards_without_slot_total":
                return float(sample.value)
    raise AssertionError("no dgr:forwards_without_slot_total in /metrics")


def test_compute_threads_are_realtime_only_where_allowed(smollm2: Path, tmp_path: Path) -> None:
    descriptor = descriptor_args(smollm2)
    slots = ["--compute-slots", str(tmp_path / "slots")]
    auto = start_worker(
        smollm2,
        0,
        30,
        descriptor=descriptor,
        threads=2,
        n_ctx=128,
        extra=[*slots, "--prio", "auto"],
    )
    normal = start_worker(smollm2, 0, 30, descriptor=descriptor, threads=2, n_ctx=128, extra=slots)
    try:
        outputs = []
        for worker in (auto, normal):
            route = Route.open([worker.address], timeout=60)
            outputs.append(list(route.generate(PROMPT, 4)))
            route.close()
        assert outputs[0] == outputs[1]
        allowed = realtime_allowed()
        # the pools' helper threads (the load's pool and the one on the slot's cores), and no
        # other: ggml gives a pool's priority to the thread that makes it or starts its graph,
        # and the worker's main thread, which made its pool at load, had gone on at SCHED_FIFO
        # with every thread it started after (gRPC's, all 16 of them); the handler that
        # computed a graph gets its policy back with it
        assert fifo_threads(auto) in ((1, 2) if allowed else (0,))
        assert policies(auto)[auto.proc.pid] != SCHED_FIFO
        assert fifo_threads(normal) == 0
    finally:
        auto.stop()
        normal.stop()


def test_a_graph_without_a_slot_computes_at_normal_priority(smollm2: Path, tmp_path: Path) -> None:
    slots = tmp_path / "slots"
    worker = start_worker(
        smollm2,
        0,
        30,
        descriptor=descriptor_args(smollm2),
        threads=2,
        n_ctx=128,
        extra=["--compute-slots", str(slots), "--metrics-listen", "127.0.0.1:0", "--prio", "auto"],
    )
    try:
        route = Route.open([worker.address], timeout=60)
        free = list(route.generate(PROMPT, 1))
        assert without_slot(worker) == 0
        held = [os.open(p, os.O_RDWR) for p in sorted(slots.glob("slot-*"))]
        assert held
        for fd in held:
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            started = time.monotonic()
            assert list(route.generate(PROMPT, 1)) == free  # waited for a slot, then computed
            assert time.monotonic() - started >= 2.0
        finally:
            for fd in held:
                os.close(fd)
        assert without_slot(worker) == 1  # the one forward of that generation
        assert list(route.generate(PROMPT, 1)) == free
        route.close()
    finally:
        worker.stop()


def test_an_unusable_slot_directory_is_a_usage_error(smollm2: Path, tmp_path: Path) -> None:
    """Warm-up takes a slot like any compute: a --compute-slots directory that cannot be made
    ends the worker with its reason and exit 2, not an abort."""
    from dgr_route.engine import locate

    blocker = tmp_path / "file"
    blocker.write_text("")
    done = subprocess.run(
        [
            str(locate("cpu").worker),
            "--model",
            str(smollm2),
            "--layers",
            "0:30",
            "--n-ctx",
            "64",
            "--compute-slots",
            str(blocker / "slots"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "--compute-slots: cannot create" in done.stderr
