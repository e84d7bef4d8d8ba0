"""Worker metrics (--metrics-listen): live workers scraped over HTTP, the Prometheus text read with
prometheus_client's own parser, and the JSON view for a tracker holding the same figures."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from dgr.v1 import shard_pb2 as pb
from dgr.v1 import shard_pb2_grpc as pb_grpc
from dgr_cli.workers import WorkerProcess, start_worker
from dgr_route.route import Route
from dgr_wire.codec import encode
from prometheus_client.parser import text_string_to_metric_families

PROMPT = list(range(1000, 1020))


def scrape(worker: WorkerProcess) -> dict[str, float]:
    """Every sample of the worker's /metrics, by name and labels, through prometheus_client."""
    assert worker.metrics_url is not None
    with urllib.request.urlopen(f"{worker.metrics_url}/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def scrape_json(worker: WorkerProcess) -> dict[str, object]:
    assert worker.metrics_url is not None
    with urllib.request.urlopen(f"{worker.metrics_url}/metrics.json", timeout=10) as r:
        assert r.headers["Content-Type"] == "application/json"
        data: dict[str, object] = json.loads(r.read())
    return data


def test_tokens_forwards_and_latency(
    metered_workers: list[WorkerProcess], metered_limits: tuple[int, int]
) -> None:
    _, max_sessions = metered_limits
    before = [scrape(w) for w in metered_workers]
    route = Route.open([w.address for w in metered_workers])
    try:
        tokens = list(route.generate(PROMPT, 8))
    finally:
        route.close()
    assert len(tokens) == 8
    for w, b in zip(metered_workers, before, strict=True):
        m = scrape(w)

        def grew(name: str, m: dict[str, float] = m, b: dict[str, float] = b) -> float:
            return m[name] - b.get(name, 0.0)

        # the prompt in one chunk, then a decode step for each token after the first
        assert grew("dgr:prompt_tokens_total") == len(PROMPT)
        assert grew("dgr:generation_tokens_total") == 7
        assert grew("dgr:forwards_total") == 8
        assert grew("dgr:forward_latency_seconds_count") == 8
        assert grew("dgr:request_queue_time_seconds_count") == 8
        assert grew("dgr:forward_latency_seconds_sum") > 0
        assert m["dgr:forward_latency_seconds_bucket{le=+Inf}"] == m["dgr:forwards_total"]
        assert m["dgr:max_sessions"] == max_sessions
        view = scrape_json(w)
        assert view["dgr:forwards_total"] == m["dgr:forwards_total"]
        latency = view["dgr:forward_latency_seconds"]
        assert isinstance(latency, dict) and latency["count"] == m["dgr:forwards_total"]


def test_gauges_follow_a_live_session(
    metered_workers: list[WorkerProcess], metered_limits: tuple[int, int]
) -> None:
    n_ctx, max_sessions = metered_limits
    decoded = [scrape(w)["dgr:generation_tokens_total"] for w in metered_workers]
    route = Route.open([w.address for w in metered_workers])
    stream = route.generate(PROMPT, 30)
    try:
        for _ in range(3):
            next(stream)
        # the head decodes on to max_tokens and holds the session until the stream closes
        deadline = time.monotonic() + 30
        while any(
            scrape(w)["dgr:generation_tokens_total"] < d + 29
            for w, d in zip(metered_workers, decoded, strict=True)
        ):
            assert time.monotonic() < deadline, "the route did not decode to max_tokens"
            time.sleep(0.05)
        for w in metered_workers:
            m = scrape(w)
            assert m["dgr:num_sessions_running"] == 1
            # the session's cache: the prompt and the decoded tokens (the last sampled one is not
            # computed yet), over n_ctx x max_sessions
            kv = (len(PROMPT) + 29) / (n_ctx * max_sessions)
            assert m["dgr:kv_cache_usage_perc"] == pytest.approx(kv)
            assert scrape_json(w)["dgr:kv_cache_usage_perc"] == pytest.approx(kv)
    finally:
        stream.close()
        route.close()
    deadline = time.monotonic() + 30
    while any(scrape(w)["dgr:num_sessions_running"] for w in metered_workers):
        assert time.monotonic() < deadline, "the sessions were not released"
        time.sleep(0.05)
    assert all(scrape(w)["dgr:kv_cache_usage_perc"] == 0 for w in metered_workers)


def test_errors_by_status_code(metered_workers: list[WorkerProcess]) -> None:
    tail = metered_workers[1]
    key = "dgr:request_errors_total{code=INVALID_ARGUMENT}"
    before = scrape(tail).get(key, 0.0)
    bad = encode(np.zeros((3, 576), dtype=np.float32), "f32")
    bad.shape[2] = 512  # not the model's n_embd
    stub = pb_grpc.ShardServiceStub(grpc.insecure_channel(tail.address))
    for _ in range(2):
        request = pb.ForwardRequest(session_id=7, expect=pb.CacheExpectation(epoch=1), boundary=bad)
        with pytest.raises(grpc.RpcError) as info:
            next(stub.Forward(iter([request]), timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    m = scrape(tail)
    assert m[key] - before == 2
    errors = scrape_json(tail)["dgr:request_errors_total"]
    assert isinstance(errors, dict) and errors["INVALID_ARGUMENT"] == m[key]


def test_only_the_two_paths_are_served(metered_workers: list[WorkerProcess]) -> None:
    """civetweb passes a handler every path under its own; the worker serves /metrics and
    /metrics.json and answers 404 for the rest."""
    url = metered_workers[0].metrics_url
    assert url is not None
    for path in ("/metrics.jsonx", "/metrics/x", "/metricsfoo", "/", "/metrics.json/.."):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"{url}{path}", timeout=10)
        assert info.value.code == 404, path
    assert "dgr:forwards_total" in scrape_json(metered_workers[0])


def test_a_busy_metrics_port_stops_the_worker(
    smollm2: Path, metered_workers: list[WorkerProcess]
) -> None:
    assert metered_workers[0].metrics_url is not None
    taken = metered_workers[0].metrics_url.removeprefix("http://")
    with pytest.raises(Exception, match="metrics-listen"):
        start_worker(smollm2, 0, 15, n_ctx=64, extra=["--metrics-listen", taken], timeout=60)


def test_dgr_worker_passes_the_flag(tmp_path: Path) -> None:
    import subprocess
    import sys

    dgr = str(Path(sys.executable).parent / "dgr")
    proc = subprocess.Popen(
        [dgr, "worker", "--layers", "0:15", "--n-ctx", "64", "--metrics-listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("DGR-WORKER-METRICS port="), first
        port = int(first.split("=", 1)[1])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            names = {f.name for f in text_string_to_metric_families(r.read().decode())}
        assert {"dgr:forwards", "dgr:num_sessions_running"} <= names
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "0.0.0.0:0"])
def test_a_worker_serving_metrics_exits_promptly(smollm2: Path, listen: str) -> None:
    """civetweb 1.15 noticed its stop only at its listener's next 2 s poll, so every worker with
    --metrics-listen took 2 s to exit after SIGTERM; the worker wakes the listener instead."""
    worker = start_worker(smollm2, 0, 15, n_ctx=64, extra=["--metrics-listen", listen])
    assert worker.metrics_url is not None
    scrape(worker)  # a listener that has served
    t0 = time.perf_counter()
    assert worker.stop() == 0
    took = time.perf_counter() - t0
    assert took < 1.0, f"the worker took {took:.2f} s to exit"
