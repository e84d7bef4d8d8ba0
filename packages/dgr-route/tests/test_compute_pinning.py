"""A worker places each forward's compute threads one on each core of the compute slot it holds
(`--pin on`, the default): woken onto the core of the thread that woke it, a pool thread would
spin at ggml's barriers in turns with it while another core idles (a 3-stage route of 2-thread
workers behind 10 ms links lost a third of its speed to that on 2 cores). The handler thread
that computes gets its own affinity back after each forward; `--pin off` leaves placement to
the kernel; the output is the same either way."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from dgr_cli.workers import WorkerProcess, descriptor_args, start_worker
from dgr_route.route import Route

PROMPT = list(range(1000, 1012))


def affinities(worker: WorkerProcess) -> list[set[int]]:
    """The CPUs each thread of the worker may run on (/proc/PID/task/TID/status)."""
    out = []
    for status in Path(f"/proc/{worker.proc.pid}/task").glob("*/status"):
        for line in status.read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                cpus: set[int] = set()
                for part in line.split(":", 1)[1].strip().split(","):
                    first, _, last = part.partition("-")
                    cpus.update(range(int(first), int(last or first) + 1))
                out.append(cpus)
    return out


def test_compute_threads_are_pinned_to_their_slot_and_the_handler_is_not(
    smollm2: Path, tmp_path: Path
) -> None:
    descriptor = descriptor_args(smollm2)
    slots = ["--compute-slots", str(tmp_path / "slots")]
    pinned = start_worker(smollm2, 0, 30, descriptor=descriptor, threads=2, n_ctx=128, extra=slots)
    free = start_worker(
        smollm2, 0, 30, descriptor=descriptor, threads=2, n_ctx=128, extra=[*slots, "--pin", "off"]
    )
    try:
        outputs = []
        for worker in (pinned, free):
            route = Route.open([worker.address], timeout=60)
            outputs.append(list(route.generate(PROMPT, 4)))
            route.close()
        assert outputs[0] == outputs[1]
        allowed = os.sched_getaffinity(0)
        # every thread but the pool's helper may run anywhere it could before: the handler that
        # computed as thread 0 was given its affinity back
        assert all(a == allowed for a in affinities(free))
        narrowed = [a for a in affinities(pinned) if a != allowed]
        if len(allowed) >= 2:  # the slot's cores: the helper on the first, thread 0 on the last
            assert narrowed == [{sorted(allowed)[0]}]
        else:  # one core cannot take two threads one each: nothing pinned
            assert narrowed == []
    finally:
        pinned.stop()
        free.stop()


def test_pin_takes_on_or_off(smollm2: Path) -> None:
    from dgr_route.engine import locate

    args = [str(locate("cpu").worker), "--model", str(smollm2), "--layers", "0:30"]
    done = subprocess.run(
        [*args, "--pin", "yes"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, done.stderr
    assert "--pin: on or off, not yes" in done.stderr


def test_more_threads_than_cores_is_said(smollm2: Path) -> None:
    """Past the process's cores, a forward's threads wait at every op's barrier for a core (64
    threads on 2 cores took minutes per token): the worker starts, and says so first."""
    from dgr_route.engine import locate

    cores = len(os.sched_getaffinity(0))
    proc = subprocess.Popen(
        [str(locate("cpu").worker), "--model", str(smollm2), "--layers", "0:30", "--no-warmup",
         "--n-ctx", "64", "--threads", str(cores + 1), "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None and proc.stdout is not None
        warning = proc.stderr.readline()
        assert warning.startswith(
            f"dgr-shard-worker: warning: --threads {cores + 1} is more than the {cores} cores"
        ), warning
        assert proc.stdout.readline().startswith("DGR-WORKER-READY port=")
    finally:
        proc.terminate()
        proc.wait(30)


def one_thread_worker(smollm2: Path, slots: Path, **kw: int) -> WorkerProcess:
    """A 1-thread worker over the whole model with its own compute-slot directory; skips on a
    single core, where there is nothing to choose between."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing to choose between")
    return start_worker(
        smollm2,
        0,
        30,
        descriptor=descriptor_args(smollm2),
        threads=1,
        n_ctx=128,
        extra=["--compute-slots", str(slots)],
        **kw,
    )


def test_a_worker_serving_one_session_waits_on_the_cores_of_slot_0(
    smollm2: Path, tmp_path: Path
) -> None:
    """One session: every thread of a 1-thread worker on slot 0's core, where each of the
    session's stages computes in turn, so that a stage is woken on a busy core rather than a
    halted one. Two sessions: back on every core, where their stages' forwards overlap."""
    worker = one_thread_worker(smollm2, tmp_path / "slots", max_sessions=2)
    allowed = os.sched_getaffinity(0)
    home = {min(allowed)}
    try:
        # relay mode: a session stays open on the worker while its generator waits
        one = Route.open([worker.address], timeout=60, mode="relay")
        two = Route.open([worker.address], timeout=60, mode="relay")
        first = one.generate(PROMPT, 3)
        next(first)  # session 1 alone
        assert all(a == home for a in affinities(worker))
        assert len(list(two.generate(PROMPT, 3))) == 3  # session 2 beside it
        assert all(a == allowed for a in affinities(worker))
        assert len(list(first)) == 2  # session 1 alone again
        assert all(a == home for a in affinities(worker))
        one.close()
        two.close()
    finally:
        worker.stop()


def test_a_worker_that_found_slot_0_taken_waits_on_every_core(
    smollm2: Path, tmp_path: Path
) -> None:
    """One session, but another compute of the host on slot 0 (here: this test holding its
    lock): the worker counts as not lone and leaves its threads on every core, from the very
    forward that found slot 0 taken on (settled, that one would compute beside the holder on
    a busy core), and settles on slot 0 again once slot 0 has been free for a while."""
    import fcntl
    import time

    slots = tmp_path / "slots"
    worker = one_thread_worker(smollm2, slots)
    allowed = os.sched_getaffinity(0)
    home = {min(allowed)}
    try:
        route = Route.open([worker.address], timeout=60, mode="relay")
        assert len(list(route.generate(PROMPT, 3))) == 3
        assert all(a == home for a in affinities(worker))
        fd = os.open(slots / f"slot-0-of-{len(allowed)}", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = route.generate(PROMPT, 3)
            next(held)  # one forward, on slot 1: it left slot 0's core before it computed
            assert all(a == allowed for a in affinities(worker))
            assert len(list(held)) == 2
            assert all(a == allowed for a in affinities(worker))
        finally:
            os.close(fd)
        time.sleep(0.5)  # slot 0 free for longer than ComputeSlots::kContendedFor
        assert len(list(route.generate(PROMPT, 3))) == 3
        assert all(a == home for a in affinities(worker))
        route.close()
    finally:
        worker.stop()
