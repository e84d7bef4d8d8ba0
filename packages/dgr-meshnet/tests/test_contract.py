"""DGR-055: every tracker input validates against its generated schema; a 1.x input only adds
optional fields to the locked 1.0 schemas; no field of the tracker's own semantics (routing,
load balancing, billing, telemetry, relay, provider) is added."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from dgr_cli.workers import WorkerProcess
from dgr_meshnet.certification import seal
from dgr_meshnet.collect import capacity, descriptor
from dgr_meshnet.inputs import (
    LOCK,
    CompatibilityDescriptor,
    LinkCost,
    SeamCostInput,
    StageCost,
    lock_snapshot,
    schema_changes,
    schema_models,
)
from dgr_prd.paths import find_root
from pydantic import BaseModel, Field, create_model

# the tracker's own concerns: DGR reports inputs, it never decides or prices
TRACKER_WORDS = (
    "price", "billing", "bill", "payment", "balance", "reward", "stake", "reputation",
    "provider", "relay", "region", "priority", "weight", "score", "route", "telemetry",
    "load_balanc",
)  # fmt: skip


def committed(name: str) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((find_root().schemas / name).read_text(encoding="utf-8"))
    return schema


def test_live_inputs_validate_against_their_committed_schemas(
    metered_workers: list[WorkerProcess],
) -> None:
    w = metered_workers[0]
    assert w.metrics_url is not None
    seam = SeamCostInput(
        boundary_bytes_per_token=576 * 4,
        stages=[
            StageCost(address=x.address, layers=x.layers,
                      compute_ms_per_token=6.5)
            for x in metered_workers
        ],
        links=[LinkCost(source=metered_workers[0].address, target=metered_workers[1].address,
                        latency_ms=1.0, bandwidth_mbps=1000.0)],
    )  # fmt: skip
    live = descriptor(w.address)
    cert = seal(
        descriptor=live, hardware_sha256="c" * 64, lane=live.lane, model="smollm2-135m-q4_1",
        layouts=1, max_abs_logit_diff=0.0, passed=True, commit="a" * 40,
        created_utc="2026-12-02T01:00:00Z",
    )  # fmt: skip
    inputs: list[BaseModel] = [live, capacity(w.address, w.metrics_url), seam, cert]
    by_model = {model: name for name, model in schema_models().items()}
    assert set(map(type, inputs)) == set(by_model)  # every input the package registers
    for value in inputs:
        jsonschema.validate(json.loads(value.model_dump_json()), committed(by_model[type(value)]))
    with pytest.raises(jsonschema.ValidationError):  # and the schema does refuse
        jsonschema.validate({**json.loads(inputs[0].model_dump_json()), "lane": "tpu"},
                            committed("tracker-compatibility.schema.json"))  # fmt: skip


def property_names(schema: Any) -> set[str]:
    names: set[str] = set()
    if isinstance(schema, dict):
        names |= set(schema.get("properties", {}))
        for value in schema.values():
            names |= property_names(value)
    elif isinstance(schema, list):
        for value in schema:
            names |= property_names(value)
    return names


def test_no_tracker_semantics() -> None:
    for name in schema_models():
        for field in property_names(committed(name)):
            assert not any(word in field for word in TRACKER_WORDS), f"{name}: {field}"


def test_the_check_would_see_a_tracker_field() -> None:
    priced = create_model("Priced", __base__=CompatibilityDescriptor, price_per_token=(float, 0.0))
    assert any("price" in f for f in property_names(priced.model_json_schema()))


def test_the_inputs_extend_the_locked_1_0_schemas() -> None:
    lock = committed(LOCK)
    now = lock_snapshot()
    assert set(lock) <= set(now), "an input was removed"
    for name, schema in lock.items():
        assert schema_changes(schema, now[name]) == [], name


def test_what_a_minor_version_may_not_do() -> None:
    base = CompatibilityDescriptor.model_json_schema()
    optional = create_model(
        "CompatibilityDescriptor", __base__=CompatibilityDescriptor,
        host_memory_note=(str | None, Field(default=None)),
    )  # fmt: skip
    assert schema_changes(base, optional.model_json_schema()) == []
    required = create_model(
        "CompatibilityDescriptor", __base__=CompatibilityDescriptor, gpu_count=(int, ...)
    )
    assert schema_changes(base, required.model_json_schema()) == [
        "CompatibilityDescriptor.gpu_count: newly required"
    ]
    retyped = create_model(
        "CompatibilityDescriptor", __base__=CompatibilityDescriptor, n_layer=(str, ...)
    )
    assert schema_changes(base, retyped.model_json_schema()) == [
        "CompatibilityDescriptor.n_layer: changed type"
    ]
    removed = json.loads(json.dumps(base))
    del removed["properties"]["recipe"]
    assert schema_changes(base, removed) == ["CompatibilityDescriptor.recipe: removed"]
