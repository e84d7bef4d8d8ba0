"""The tracker inputs as versioned pydantic models; their JSON Schemas are generated into schemas/
(`nox -s prd`) and drift-checked like every schema of the workspace.

Versioning: every input carries `input_version`, "MAJOR.MINOR". A minor version only adds optional
fields; removing, retyping or requiring a field is a new major version. `schema_changes` finds
what a minor version may not do, mechanically (as protolint does for the wire).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from dgr_wire.ranges import LayerRange
from pydantic import BaseModel, ConfigDict, Field, model_validator

INPUT_VERSION: Literal["1.0"] = "1.0"
HEX40 = r"^[0-9a-f]{40}$"
HEX64 = r"^[0-9a-f]{64}$"
Lane = Literal["cpu", "cuda", "rocm", "vulkan", "metal"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class _Input(_Strict):
    input_version: Literal["1.0"] = Field(
        default=INPUT_VERSION, description="MAJOR.MINOR of this input"
    )


class CompatibilityDescriptor(_Input):
    """What must agree exactly for two workers to serve one route (DGR-050)."""

    model_fingerprint: str = Field(
        pattern=HEX64, description="dgr-artifacts fingerprint of the GGUF"
    )
    llama_cpp_commit: str = Field(pattern=HEX40, description="pinned llama.cpp commit, compiled in")
    patch_stack_sha256: str = Field(
        pattern=HEX64, description="the numbered patch stack, compiled in"
    )
    schema_version: int = Field(ge=1, description="of the dgr wire (dgr.v1: 1)")
    lane: Lane = Field(description="the compile lane of the worker")
    arch: str = Field(min_length=1, max_length=64, description="GGUF general.architecture")
    n_layer: int = Field(ge=1, description="main layers of the whole model")
    recipe: str | None = Field(
        default=None,
        max_length=128,
        description="id of the recipe the worker serves (DGR-056), if started with one",
    )


EXACT_FIELDS = tuple(f for f in CompatibilityDescriptor.model_fields if f != "input_version")


class IncompatibleError(ValueError):
    """Two descriptors differ; `fields` names every field that does."""

    def __init__(self, fields: list[str], a: CompatibilityDescriptor, b: CompatibilityDescriptor):
        self.fields = fields
        detail = "; ".join(f"{f}: {getattr(a, f)!r} != {getattr(b, f)!r}" for f in fields)
        super().__init__(f"incompatible workers: {detail}")


def mismatched_fields(a: CompatibilityDescriptor, b: CompatibilityDescriptor) -> list[str]:
    return [f for f in EXACT_FIELDS if getattr(a, f) != getattr(b, f)]


def require_compatible(a: CompatibilityDescriptor, b: CompatibilityDescriptor) -> None:
    """Compatible if and only if every exact field agrees; otherwise IncompatibleError."""
    fields = mismatched_fields(a, b)
    if fields:
        raise IncompatibleError(fields, a, b)


class RangeCapacityReport(_Input):
    """What one worker owns and can still take (DGR-051), as the worker itself reports it."""

    descriptor: CompatibilityDescriptor
    layers: LayerRange
    memory_measured_bytes: int = Field(ge=0, description="the worker process's resident memory")
    memory_estimated_bytes: int = Field(
        ge=0, description="the engine's buffers for the range: weights, KV cache, compute"
    )
    max_sessions: int = Field(ge=1)
    free_sessions: int = Field(ge=0)
    n_ctx_per_session: int = Field(ge=1)
    kv_tokens_left: int = Field(ge=0, description="tokens the KV caches can still take, in all")
    draining: bool

    @model_validator(mode="after")
    def _consistent(self) -> RangeCapacityReport:
        if self.layers.last > self.descriptor.n_layer:
            raise ValueError(
                f"layers end at {self.layers.last} > n_layer {self.descriptor.n_layer}"
            )
        if self.free_sessions > self.max_sessions:
            raise ValueError(
                f"free_sessions {self.free_sessions} > max_sessions {self.max_sessions}"
            )
        if self.kv_tokens_left > self.n_ctx_per_session * self.max_sessions:
            raise ValueError("kv_tokens_left exceeds n_ctx_per_session x max_sessions")
        return self


class StageCost(_Strict):
    address: str = Field(min_length=1)
    layers: LayerRange
    compute_ms_per_token: float = Field(ge=0, description="decode compute of the range, measured")


class LinkCost(_Strict):
    source: str = Field(min_length=1, description="address of the sending stage (or client)")
    target: str = Field(min_length=1, description="address of the receiving stage")
    latency_ms: float = Field(ge=0, description="one-way")
    bandwidth_mbps: float = Field(gt=0)


class SeamCostInput(_Input):
    """Per-stage compute and per-link latency and bandwidth: what the seam-cost model (DGR-053)
    turns into a predicted time per decode token."""

    boundary_bytes_per_token: int = Field(
        ge=1, description="residual bytes one token moves per seam"
    )
    stages: list[StageCost] = Field(min_length=1)
    links: list[LinkCost]


def schema_models() -> dict[str, type[BaseModel]]:
    """The `dgr.schemas` entry point: the file each input's JSON Schema is generated into."""
    from dgr_meshnet.certification import CertificationRecord  # it builds on these models

    return {
        "tracker-compatibility.schema.json": CompatibilityDescriptor,
        "tracker-capacity.schema.json": RangeCapacityReport,
        "tracker-seam-cost.schema.json": SeamCostInput,
        "tracker-certification.schema.json": CertificationRecord,
    }


LOCK = "tracker-inputs.v1.lock.json"  # in schemas/: the 1.0 schemas every 1.x must extend


def lock_snapshot() -> dict[str, Any]:
    """The inputs' schemas as they are now, by file name (what the lock records)."""
    return {name: model.model_json_schema() for name, model in schema_models().items()}


def _objects(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every object schema by name: the top level and its $defs."""
    out = {str(schema.get("title", "")): schema}
    out.update(schema.get("$defs", {}))
    return out


def _shape(prop: dict[str, Any]) -> str:
    """A property's type, without its prose."""
    return json.dumps(
        {k: v for k, v in prop.items() if k not in ("description", "title")}, sort_keys=True
    )


def schema_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What `new` does that a minor version may not: a field removed or retyped, a new required
    field, an object gone. Adding optional fields (and objects) is fine."""
    problems = []
    new_objects = _objects(new)
    for name, before in _objects(old).items():
        after = new_objects.get(name)
        if after is None:
            problems.append(f"{name}: removed")
            continue
        props_before, props_after = before.get("properties", {}), after.get("properties", {})
        for field, prop in props_before.items():
            if field == "input_version":  # its value is the version itself
                continue
            if field not in props_after:
                problems.append(f"{name}.{field}: removed")
            elif _shape(prop) != _shape(props_after[field]):
                problems.append(f"{name}.{field}: changed type")
        for field in set(after.get("required", [])) - set(before.get("required", [])):
            problems.append(f"{name}.{field}: newly required")
    return sorted(problems)
