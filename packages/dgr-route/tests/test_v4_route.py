"""DeepSeek V4 over real worker processes, on the generated quick twin: logits over the route equal
the whole model bit for bit, the sideband reaches hash-routed stages, and a wrong boundary or a
missing sideband is INVALID_ARGUMENT naming what was wrong."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from dgr.v1 import shard_pb2 as pb
from dgr.v1 import shard_pb2_grpc as pb_grpc
from dgr_cli.workers import WorkerProcess, descriptor_args, start_worker
from dgr_native.parity import reference_run
from dgr_route.route import Route
from dgr_wire.codec import encode

LAYOUT = [(0, 2), (2, 3), (3, 6)]  # seams inside the hash-routed block and before an HCA layer


@pytest.fixture(scope="module")
def fleet(quick_twin: Path) -> Iterator[list[WorkerProcess]]:
    descriptor = descriptor_args(quick_twin)
    workers = [start_worker(quick_twin, a, b, descriptor=descriptor, n_ctx=512) for a, b in LAYOUT]
    yield workers
    for w in workers:
        w.stop()


def forward_once(worker: WorkerProcess, request: pb.ForwardRequest) -> pb.ForwardReply:
    stub = pb_grpc.ShardServiceStub(grpc.insecure_channel(worker.address))
    reply: pb.ForwardReply = next(stub.Forward(iter([request]), timeout=30))
    return reply


@pytest.mark.parametrize("mode", ["forward", "relay"])
def test_route_logits_equal_the_whole_model(
    quick_twin: Path, fleet: list[WorkerProcess], mode: str
) -> None:
    prompt = np.random.default_rng(5).integers(0, 1024, 160).astype(np.int32)
    _, ref_logits, ref_tokens = reference_run(quick_twin, 6, prompt)
    route = Route.open([w.address for w in fleet], mode=mode)
    try:
        assert [s.describe.boundary.hc for s in route.stages] == [4, 4, 4]
        assert [s.describe.boundary.needs_token_ids for s in route.stages] == [True, True, False]
        trace = list(route.trace([int(t) for t in prompt], len(ref_logits)))
    finally:
        route.close()
    got = np.stack([logits for _, logits in trace])
    assert np.array_equal(got.view(np.uint32), np.stack(ref_logits).view(np.uint32))
    assert [t for t, _ in trace] == ref_tokens
    if mode == "relay":  # the boundaries pass the coordinator, which counts them
        per_token = route.wire.per_token()
        assert per_token["sideband"] == 4 and per_token["boundary"] > 4 * 64 * 4


def test_bad_v4_boundaries_are_invalid_argument(fleet: list[WorkerProcess]) -> None:
    middle = fleet[1]  # owns hash-routed layer 2
    good = encode(np.zeros((3, 256), np.float32), "f32", hc=4)
    wrong_hc = encode(np.zeros((3, 256), np.float32), "f32", hc=1)
    cases = [
        (
            pb.ForwardRequest(session_id=5, expect=pb.CacheExpectation(epoch=1), boundary=wrong_hc),
            "does not match this stage's [n_tokens, 4, 64]",
        ),
        (
            pb.ForwardRequest(session_id=5, expect=pb.CacheExpectation(epoch=1), boundary=good),
            "token-ID sideband",
        ),
    ]
    for request, needle in cases:
        with pytest.raises(grpc.RpcError) as info:
            forward_once(middle, request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in (info.value.details() or "")
    ok = pb.ForwardRequest(
        session_id=6, expect=pb.CacheExpectation(epoch=1), boundary=good, token_ids=[1, 2, 3]
    )
    assert list(forward_once(middle, ok).boundary.shape) == [3, 4, 64]


def test_the_demo_runs_the_quick_twin(quick_twin: Path) -> None:
    import subprocess

    run = subprocess.run(
        ["dgr", "demo", "--model", "dsv4-twin-quick", "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "8 greedy tokens identical" in run.stdout


def test_a_bf16_wire_equals_the_same_rounding_in_one_process(
    quick_twin: Path, fleet: list[WorkerProcess]
) -> None:
    from dgr_cert.layout_parity import free_run

    prompt = np.random.default_rng(9).integers(0, 1024, 140).astype(np.int32)
    want = free_run(quick_twin, LAYOUT, "bf16", prompt, 5)
    route = Route.open([w.address for w in fleet], wire_dtype="bf16")
    try:
        trace = list(route.trace([int(t) for t in prompt], 5))
    finally:
        route.close()
    got = np.stack([logits for _, logits in trace])
    assert np.array_equal(got.view(np.uint32), np.stack(want).view(np.uint32))
    assert route.wire.per_token()["boundary"] < 2 * 64 * 4 + 64  # bf16 rows, not f32
    with pytest.raises(ValueError, match="wire dtype"):
        Route.open([w.address for w in fleet], wire_dtype="f8")
    bad = pb.ForwardRequest(session_id=3, token_ids=[1], boundary_dtype=9)  # type: ignore[arg-type]
    with pytest.raises(grpc.RpcError) as info:
        forward_once(fleet[0], bad)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "boundary_dtype" in (info.value.details() or "")


def test_prefix_reuse_is_refused_on_v4_and_the_route_prefills_in_full(
    fleet: list[WorkerProcess],
) -> None:
    """V4 rounds a row by its batch's shape (attention, the compressors): a suffix computed after
    a kept prefix gives the same tokens as a full prefill but other logits (measured here before
    the stages refused), so V4 stages keep nothing for reuse and say so in Describe; a route asking
    is refused and prefills in full, bit for bit the same as a route that never asks."""
    from dgr_route.route import DraftUsage, Sampling

    rng = np.random.default_rng(11)
    prompt = [int(t) for t in rng.integers(0, 1024, 200)]
    more = [int(t) for t in rng.integers(0, 1024, 24)]
    addresses = [w.address for w in fleet]

    def run(route: Route, tokens: list[int], n: int) -> tuple[list[int], np.ndarray, int]:
        usage, out, rows = DraftUsage(), [], []
        for r in route.results(tokens, n, Sampling(want_logits=True), usage=usage):
            out.append(int(r.token_id))
            rows.append(np.frombuffer(r.logits.payload, dtype=np.float32))
        return out, np.stack(rows), usage.cached_tokens

    held = [w.sessions() for w in fleet]  # (an earlier test's one-shot stream may hold one)
    full = Route.open(addresses, prefix_reuse=False)
    reuse = Route.open(addresses)
    try:
        assert [s.describe.prefix_cache_sessions for s in reuse.stages] == [0, 0, 0]
        first, _, _ = run(reuse, prompt, 8)
        history = prompt + first + more
        ref_tokens, ref_logits, _ = run(full, history, 8)
        tokens, logits, cached = run(reuse, history, 8)
        assert cached == 0 and tokens == ref_tokens
        assert np.array_equal(logits.view(np.uint32), ref_logits.view(np.uint32))
        deadline = time.monotonic() + 5  # the stages free their sessions as the streams end
        while [w.sessions() for w in fleet] != held and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [w.sessions() for w in fleet] == held
    finally:
        full.close()
        reuse.close()
