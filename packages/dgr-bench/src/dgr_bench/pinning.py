"""Stage pinning for the gate's host condition (dgr_prd.gate): with `--pin-stages`, each process a
bench starts computes on cores of its own, stage i of a fleet (or RPC server i) on cores
[i * threads, (i + 1) * threads), recorded in the bench's JSON. Where the host has fewer cores
than a fleet's threads, nothing is pinned and the JSON says so: the gate then counts the rows as
not measurable here."""

from __future__ import annotations

import os

_enabled = False


def enable(on: bool) -> None:
    global _enabled
    _enabled = on


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def stage_cpus(index: int, threads: int) -> list[int] | None:
    """The cores of stage `index` (None: not pinned, off or too few cores)."""
    mine = cores()
    if not _enabled or (index + 1) * threads > len(mine):
        return None
    return mine[index * threads : (index + 1) * threads]


def worker_args(index: int, threads: int) -> list[str]:
    """dgr-shard-worker's --cpus for stage `index`, or nothing."""
    cpus = stage_cpus(index, threads)
    return ["--cpus", ",".join(map(str, cpus))] if cpus else []


def taskset(index: int, threads: int) -> list[str]:
    """A command prefix that runs a process (an RPC server) on stage `index`'s cores, or nothing."""
    cpus = stage_cpus(index, threads)
    return ["taskset", "-c", ",".join(map(str, cpus))] if cpus else []


def record(stages: int, threads: int) -> dict[str, object]:
    """What the JSON records: whether the fleets' stages ran pinned, and where."""
    pinned = [stage_cpus(i, threads) for i in range(stages)]
    return {
        "requested": _enabled,
        "pinned": _enabled and all(p is not None for p in pinned),
        "cores": len(cores()),
        "stage_cpus": pinned,
    }
