"""schemas/ matches the pydantic models, and the committed files validate against them."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from dgr_prd.evidence import EVIDENCE_FILE
from dgr_prd.model import Prd
from dgr_prd.paths import RepoPaths
from dgr_prd.schemas import render, stale_schemas, write_schemas


def test_committed_schemas_match_the_models(repo: RepoPaths) -> None:
    assert stale_schemas(repo.schemas) == [], "run `nox -s prd` to regenerate schemas/"


def test_drift_is_detected(tmp_path: Any) -> None:
    write_schemas(tmp_path)
    assert stale_schemas(tmp_path) == []
    path = tmp_path / "prd.schema.json"
    schema = json.loads(path.read_text())
    schema["properties"]["stories"]["minItems"] = 0
    path.write_text(json.dumps(schema))
    assert stale_schemas(tmp_path) == ["prd.schema.json"]
    (tmp_path / "evidence.schema.json").unlink()
    assert sorted(stale_schemas(tmp_path)) == ["evidence.schema.json", "prd.schema.json"]


def test_prd_json_validates_with_jsonschema(repo: RepoPaths, prd_data: dict[str, Any]) -> None:
    schema = json.loads((repo.schemas / "prd.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(prd_data, schema)


def test_schema_rejects_an_unknown_lane(repo: RepoPaths, prd_data: dict[str, Any]) -> None:
    schema = json.loads((repo.schemas / "prd.schema.json").read_text())
    prd_data["stories"][3]["evidence"][0]["lane"] = "tpu"
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(prd_data))
    assert errors and "tpu" in errors[0].message


def test_every_committed_evidence_record_validates(repo: RepoPaths) -> None:
    schema = json.loads((repo.schemas / "evidence.schema.json").read_text())
    records = sorted(repo.evidence.glob(f"DGR-*/*/{EVIDENCE_FILE}"))
    for path in records:
        jsonschema.validate(json.loads(path.read_text()), schema)


def test_render_is_deterministic() -> None:
    assert render(Prd) == render(Prd)
