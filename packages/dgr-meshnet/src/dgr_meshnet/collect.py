"""The tracker inputs of a live worker, from what it serves: Describe and Health over gRPC, and
its metrics' JSON view (`--metrics-listen`) for memory and KV use."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from dgr.v1 import shard_pb2 as pb
from dgr.v1 import shard_pb2_grpc as pb_grpc
from dgr_route.security import PLAIN, Security
from dgr_wire.ranges import LayerRange

from dgr_meshnet.inputs import CompatibilityDescriptor, RangeCapacityReport


def _ask(address: str, security: Security, timeout: float) -> tuple[Any, Any]:
    channel = security.channel(address)
    try:
        stub = pb_grpc.ShardServiceStub(channel)  # type: ignore[no-untyped-call]  # generated
        md = security.metadata
        describe = stub.Describe(pb.DescribeRequest(), timeout=timeout, metadata=md)
        health = stub.Health(pb.HealthRequest(), timeout=timeout, metadata=md)
        return describe, health
    finally:
        channel.close()


def descriptor_of(reply: Any) -> CompatibilityDescriptor:
    """The exact descriptor from a DescribeReply (validated: a worker reporting a malformed
    field is refused here, by field)."""
    c = reply.compatibility
    return CompatibilityDescriptor(
        model_fingerprint=c.model_fingerprint,
        llama_cpp_commit=c.llama_cpp_commit,
        patch_stack_sha256=c.patch_stack_sha256,
        schema_version=c.schema_version,
        lane=c.lane,
        arch=c.arch,
        n_layer=c.n_layer,
        recipe=c.recipe or None,
    )


def descriptor(
    address: str, security: Security = PLAIN, timeout: float = 10.0
) -> CompatibilityDescriptor:
    reply, _ = _ask(address, security, timeout)
    return descriptor_of(reply)


def metrics_view(metrics_url: str, timeout: float = 10.0) -> dict[str, Any]:
    with urllib.request.urlopen(f"{metrics_url}/metrics.json", timeout=timeout) as r:
        view: dict[str, Any] = json.loads(r.read())
    return view


def capacity(
    address: str, metrics_url: str, security: Security = PLAIN, timeout: float = 10.0
) -> RangeCapacityReport:
    """The worker's range and capacity report (its metrics port must be served)."""
    describe, health = _ask(address, security, timeout)
    view = metrics_view(metrics_url, timeout)
    total_kv = describe.n_ctx * describe.max_sessions
    used_kv = round(float(view["dgr:kv_cache_usage_perc"]) * total_kv)
    memory = view["dgr:memory_bytes"]
    return RangeCapacityReport(
        descriptor=descriptor_of(describe),
        layers=LayerRange(first=describe.layer_first, last=describe.layer_last),
        memory_measured_bytes=int(view["process_resident_memory_bytes"]),
        memory_estimated_bytes=int(memory["model"] + memory["kv"] + memory["compute"]),
        max_sessions=describe.max_sessions,
        free_sessions=health.capacity,
        n_ctx_per_session=describe.n_ctx,
        kv_tokens_left=total_kv - used_kv,
        draining=health.draining,
    )
