"""What the planner knows of a model, measured before anything is placed.

Memory (the per-range estimator): a stage over [a, b) holds the weights the manifest's range
subset names, the KV (and recurrent) state of its layers, the compute buffers of its kind (a
head embeds, a tail holds the logits of a batch) and the worker process's fixed overhead.
llama.cpp's own dry run (`estimate_only`: nothing allocated) gives the KV bytes of each layer
and the compute buffers of each kind, at the options the workers will run with; a real worker
over one layer gives the overhead (its RSS less its dry-run estimate).

Compute (`probe`): time per decode token of a head (0,1), a middle (1,L-1) and a tail (L-1,L)
engine chained in one process at the node's threads: a mean layer, the embedding and the output.
Layers are weighted by their weight bytes (decode reads every weight once per token).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Literal

from dgr_artifacts.manifest import ArtifactManifest
from dgr_artifacts.subset import HEAD_TENSORS, TAIL_TENSORS
from pydantic import BaseModel, ConfigDict, Field

from dgr_placement.nodes import Compute

PROTOCOL_BYTES = 60  # gRPC/HTTP2 framing and the message's own fields (bench-seam-bytes: ~124)
TOKEN_MESSAGE_BYTES = 64  # the tail's sampled token, to the head


class WorkerOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    n_ctx: int = Field(default=2048, ge=8)
    max_sessions: int = Field(default=4, ge=1)
    n_batch: int = Field(default=512, ge=1)


class ModelProfile(BaseModel):
    """Per-layer bytes and the fixed parts, enough to size any range without loading it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model_fingerprint: str
    manifest_sha256: str
    n_layer: int
    options: WorkerOptions
    layer_weight_bytes: list[int]
    shared_weight_bytes: int = Field(description="global tensors every stage loads")
    head_weight_bytes: int = Field(description="the token embedding")
    tail_weight_bytes: int = Field(description="output norm and head (and a tied embedding)")
    tied_output: bool
    layer_kv_bytes: list[int]
    compute_bytes: dict[Literal["head", "middle", "tail", "whole"], int]
    overhead_bytes: int = Field(description="a worker process whatever its range")
    boundary_bytes: dict[str, int] = Field(description="per token per seam, by wire dtype")

    def weights(self, first: int, last: int) -> int:
        total = self.shared_weight_bytes + sum(self.layer_weight_bytes[first:last])
        head, tail = first == 0, last == self.n_layer
        if head:
            total += self.head_weight_bytes
        if tail:
            total += self.tail_weight_bytes
            if head and self.tied_output:  # the one embedding serves both ends
                total -= self.head_weight_bytes
        return total

    def kind(self, first: int, last: int) -> Literal["head", "middle", "tail", "whole"]:
        head, tail = first == 0, last == self.n_layer
        return "whole" if head and tail else "head" if head else "tail" if tail else "middle"

    def stage_bytes(self, first: int, last: int) -> int:
        """What a worker over [first, last) holds: the estimate plus the process overhead."""
        return (
            self.weights(first, last)
            + sum(self.layer_kv_bytes[first:last])
            + self.compute_bytes[self.kind(first, last)]
            + self.overhead_bytes
        )

    def layer_weights(self) -> list[float]:
        """Each layer's share of decode compute, relative to a mean layer (1.0)."""
        mean = sum(self.layer_weight_bytes) / self.n_layer
        return [b / mean for b in self.layer_weight_bytes]


def weight_split(manifest: ArtifactManifest) -> dict[str, Any]:
    layers = [0] * manifest.n_layer
    shared = head = tail = 0
    tied = not any(t.name.startswith("output.") for t in manifest.tensors)
    for t in manifest.tensors:
        if t.layer is not None:
            if t.layer < manifest.n_layer:  # MTP/nextn layers belong to no main range
                layers[t.layer] += t.nbytes
        elif t.name.startswith(HEAD_TENSORS):
            head += t.nbytes
        elif t.name.startswith(TAIL_TENSORS):
            tail += t.nbytes
        else:
            shared += t.nbytes
    if tied:
        tail += head
    return {
        "layer_weight_bytes": layers,
        "shared_weight_bytes": shared,
        "head_weight_bytes": head,
        "tail_weight_bytes": tail,
        "tied_output": tied,
    }


def _estimate(engine_module: Any, model: Path, first: int, last: int, o: WorkerOptions) -> Any:
    return engine_module.Engine(
        str(model),
        first,
        last,
        estimate_only=True,
        n_ctx=o.n_ctx,
        n_batch=o.n_batch,
        max_sessions=o.max_sessions,
    ).describe()


def worker_overhead(model: Path, options: WorkerOptions, estimate: int, layer: int) -> int:
    """RSS of a real dgr-shard-worker over one middle layer, less what the dry run says it
    holds: the binary, libllama, gRPC, metadata and vocabulary."""
    from dgr_cli.workers import start_worker

    worker = start_worker(
        model,
        layer,
        layer + 1,
        n_ctx=options.n_ctx,
        n_batch=options.n_batch,
        max_sessions=options.max_sessions,
        threads=1,
    )
    try:
        status = Path(f"/proc/{worker.proc.pid}/status").read_text()
        rss = next(
            int(ln.split()[1]) * 1024 for ln in status.splitlines() if ln.startswith("VmRSS")
        )
    finally:
        worker.stop()
    return max(0, rss - estimate)


def profile_model(model: Path, manifest: ArtifactManifest, options: WorkerOptions) -> ModelProfile:
    from dgr_route.engine import locate

    m = locate().module()
    n = manifest.n_layer
    per_layer = [_estimate(m, model, i, i + 1, options) for i in range(n)]
    whole = _estimate(m, model, 0, n, options)
    kinds: dict[Literal["head", "middle", "tail", "whole"], int] = {
        "head": int(per_layer[0]["compute_bytes"]),
        "middle": int(per_layer[n // 2]["compute_bytes"]) if n > 2 else 0,
        "tail": int(per_layer[-1]["compute_bytes"]),
        "whole": int(whole["compute_bytes"]),
    }
    mid = min(n // 2, n - 1)
    d = per_layer[mid]
    estimate = int(d["weight_bytes"]) + int(d["kv_bytes"]) + int(d["compute_bytes"])
    hc, n_embd = int(whole.get("hc", 1)), int(whole["n_embd"])
    sizes = {"f32": 4, "f16": 2, "bf16": 2}
    return ModelProfile(
        model_fingerprint=manifest.model_fingerprint,
        manifest_sha256=manifest.digest(),
        n_layer=n,
        options=options,
        **weight_split(manifest),
        layer_kv_bytes=[int(d["kv_bytes"]) for d in per_layer],
        compute_bytes=kinds,
        overhead_bytes=worker_overhead(model, options, estimate, mid),
        boundary_bytes={k: hc * n_embd * s + PROTOCOL_BYTES for k, s in sizes.items()},
    )


class ProbeError(ValueError):
    """This machine cannot measure the compute asked for."""


def usable_cores() -> int:
    """The cores this process may run on (its affinity, as taskset or a container sets it)."""
    import os

    return len(os.sched_getaffinity(0))


def check_probe(threads: int) -> None:
    """A probe at more threads than this machine's cores would time ggml's barriers spinning
    against each other (minutes of it: a 2-core host at 4 threads), not the node."""
    cores = usable_cores()
    if threads < 1 or threads > cores:
        raise ProbeError(
            f"cannot probe {threads} threads on this machine's {cores} usable cores: run "
            f"`dgr plan --probe-threads {threads} --model M` on the node itself and give its "
            "`compute:` line in nodes.yaml"
        )


def probe(model: Path, threads: int, prompt: int = 32, decode: int = 24) -> Compute:
    """The node's compute at `threads`: `probe_engines`, then the fixed cost of a stage.
    ProbeError where this machine has fewer usable cores than `threads`."""
    check_probe(threads)
    compute = probe_engines(model, threads, prompt, decode)
    return compute.model_copy(update={"stage_ms": probe_stage(model, threads, compute)})


def probe_stage(
    model: Path,
    threads: int,
    compute: Compute,
    decode: int = 64,
    rounds: int = 5,
    stages: int = 2,
) -> float:
    """What a stage costs per token beyond its layers: a route of `stages` real workers on
    loopback (forward mode) against the engines' times for the same layers and one loopback hop
    per stage (half a gRPC Health round trip each: the seams and the token back to the head),
    split over the stages. It includes what the other workers' idle threads take from the one
    computing, as a route of several stages on shared cores has it."""
    from dgr_cli.workers import descriptor_args, start_worker
    from dgr_route.local import even_layout

    n = int(_describe(model)["n_layer"])
    descriptor = descriptor_args(model)
    workers = [
        start_worker(model, a, b, threads=threads, n_ctx=128, max_sessions=1, descriptor=descriptor)
        for a, b in even_layout(n, stages)
    ]
    try:
        addresses = [w.address for w in workers]
        hop_ms = one_way_ms(addresses[0], calls=20)
        token_ms = _decode_ms(addresses, [1000 + i for i in range(32)], decode, rounds)
    finally:
        for w in workers:
            w.stop()
    layers_ms = compute.ms_per_layer * n + compute.head_ms + compute.tail_ms
    hops_ms = stages * hop_ms
    return round(max(0.0, (token_ms - layers_ms - hops_ms) / stages), 4)


def one_way_ms(address: str, calls: int = 30) -> float:
    """A link's one-way time as a deployment measures it: half the median round trip of a gRPC
    Health call to the worker at `address` (one call first, to open the connection)."""
    import grpc
    from dgr.v1 import shard_pb2 as pb
    from dgr.v1 import shard_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ShardServiceStub(channel)  # type: ignore[no-untyped-call]
        stub.Health(pb.HealthRequest(), timeout=10)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            stub.Health(pb.HealthRequest(), timeout=10)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000 / 2


def _decode_ms(addresses: list[str], prompt: list[int], decode: int, rounds: int) -> float:
    """Median ms per decode token of greedy generations through a forward-mode route."""
    from dgr_route.route import Route

    route = Route.open(addresses, timeout=120, mode="forward", peers=addresses, prefix_reuse=False)
    try:
        per_token = []
        for _ in range(rounds):
            stream = route.generate(prompt, decode + 1)
            next(stream)  # the prefill's token: not a decode step
            t0 = time.perf_counter()
            for _ in stream:
                pass
            per_token.append((time.perf_counter() - t0) / decode)
    finally:
        route.close()
    return statistics.median(per_token) * 1000


def _describe(model: Path) -> Any:
    from dgr_route.engine import locate

    return locate().module().Engine(str(model), 0, 1, estimate_only=True).describe()


def probe_engines(model: Path, threads: int, prompt: int = 32, decode: int = 48) -> Compute:
    """Time per decode token of a mean layer, the embedding and the output at `threads`: a head
    (0,1), a middle (1,L-1) and a tail (L-1,L) engine, one alive at a time (an idle engine's
    spinning threads would take the cores from the one timed), each fed what the previous one
    produced for a prompt and `decode` single-token steps."""
    import numpy as np
    from dgr_route.engine import locate

    m = locate().module()
    n = int(_describe(model)["n_layer"])
    if n < 3:
        raise ValueError(f"the probe needs 3 or more layers; {model} has {n}")
    opts = {"n_ctx": prompt + decode + 8, "n_threads": threads, "max_sessions": 1}
    ids = np.arange(1000, 1000 + prompt + decode, dtype=np.int32)
    steps: list[Any] = [ids[:prompt], *(ids[prompt + i : prompt + i + 1] for i in range(decode))]
    medians = []
    for part, (first, last) in enumerate(((0, 1), (1, n - 1), (n - 1, n))):
        engine = m.Engine(str(model), first, last, **opts)
        times, outputs, pos = [], [], 0
        for k, step in enumerate(steps):
            t0 = time.perf_counter()
            if part == 0:
                out = engine.forward(1, 1, pos, tokens=step)
            else:
                out = engine.forward(1, 1, pos, boundary=step)
            if k:
                times.append(time.perf_counter() - t0)
            outputs.append(out)
            pos += len(step)
        engine.release(1)
        del engine
        medians.append(statistics.median(times) * 1000)
        steps = outputs
    head, middle, tail = medians
    layer = middle / (n - 2)
    return Compute(
        ms_per_layer=round(layer, 4),
        head_ms=round(max(0.0, head - layer), 4),
        tail_ms=round(max(0.0, tail - layer), 4),
    )
