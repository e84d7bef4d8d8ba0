"""DGR-051: the range and capacity report of a live worker matches its measured state (idle and
while a session holds its cache) and validates against its committed JSON Schema."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jsonschema
import pytest
from dgr_cli.workers import WorkerProcess
from dgr_meshnet.collect import capacity
from dgr_meshnet.inputs import RangeCapacityReport
from dgr_prd.paths import find_root
from dgr_route.route import Route
from pydantic import ValidationError

PROMPT = list(range(1000, 1024))


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text(encoding="utf-8").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def report(w: WorkerProcess) -> RangeCapacityReport:
    assert w.metrics_url is not None
    r = capacity(w.address, w.metrics_url)
    schema = json.loads(
        (find_root().schemas / "tracker-capacity.schema.json").read_text(encoding="utf-8")
    )
    jsonschema.validate(json.loads(r.model_dump_json()), schema)
    return r


def test_idle_report_matches_the_worker(
    metered_workers: list[WorkerProcess], metered_limits: tuple[int, int]
) -> None:
    n_ctx, max_sessions = metered_limits
    for w in metered_workers:
        r = report(w)
        assert r.layers == w.layers
        assert (r.max_sessions, r.free_sessions) == (max_sessions, max_sessions)
        assert r.n_ctx_per_session == n_ctx
        assert r.kv_tokens_left == n_ctx * max_sessions
        assert not r.draining
        measured = rss_bytes(w.proc.pid)
        assert abs(r.memory_measured_bytes - measured) <= 0.05 * measured
        # the alpha memory gate's bound (rss over estimate <= 1.15), with the process's fixed
        # overhead (libraries, vocabulary, gRPC) beside it; reserved compute pages may never be
        # touched, so the estimate can exceed what is resident
        assert r.memory_estimated_bytes > 0
        assert r.memory_measured_bytes <= 1.15 * r.memory_estimated_bytes + 64 * 2**20


def test_a_live_session_takes_a_slot_and_its_cache(
    metered_workers: list[WorkerProcess], metered_limits: tuple[int, int]
) -> None:
    n_ctx, max_sessions = metered_limits
    route = Route.open([w.address for w in metered_workers])
    stream = route.generate(PROMPT, 20)
    try:
        next(stream)
        # the head decodes on to max_tokens: 19 decode steps after the prompt, on both stages
        expected_left = n_ctx * max_sessions - (len(PROMPT) + 19)
        deadline = time.monotonic() + 30
        while any(report(w).kv_tokens_left != expected_left for w in metered_workers):
            assert time.monotonic() < deadline, [report(w) for w in metered_workers]
            time.sleep(0.05)
        for w in metered_workers:
            assert report(w).free_sessions == max_sessions - 1
    finally:
        stream.close()
        route.close()
    deadline = time.monotonic() + 30
    while any(report(w).free_sessions != max_sessions for w in metered_workers):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_an_inconsistent_report_is_refused(
    metered_workers: list[WorkerProcess], metered_limits: tuple[int, int]
) -> None:
    n_ctx, max_sessions = metered_limits
    good = report(metered_workers[0]).model_dump()
    for change, needle in [
        ({"free_sessions": max_sessions + 1}, "free_sessions"),
        ({"layers": {"first": 10, "last": 5}}, "first"),
        ({"layers": {"first": 0, "last": 31}}, "n_layer"),
        ({"kv_tokens_left": n_ctx * max_sessions + 1}, "kv_tokens_left"),
        ({"memory_measured_bytes": -1}, "memory_measured_bytes"),
    ]:
        with pytest.raises(ValidationError, match=needle):
            RangeCapacityReport.model_validate({**good, **change})
