"""JSON Schemas generated from the pydantic models; schemas/ holds the committed copies.

Every package of the workspace contributes its models through the `dgr.schemas` entry-point group
(a callable returning {file name: model class}), so one generator and one drift check serve all.
"""

from __future__ import annotations

import json
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from dgr_prd.evidence import EvidenceRecord
from dgr_prd.model import Prd

ENTRY_POINT_GROUP = "dgr.schemas"


def prd_models() -> dict[str, type[BaseModel]]:
    return {"prd.schema.json": Prd, "evidence.schema.json": EvidenceRecord}


def registered_models() -> dict[str, type[BaseModel]]:
    models: dict[str, type[BaseModel]] = {}
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        contributed = ep.load()()
        clash = set(models) & set(contributed)
        if clash:
            raise RuntimeError(f"schema file names registered twice: {sorted(clash)}")
        models.update(contributed)
    return models


def render(model: type[BaseModel]) -> str:
    schema: dict[str, Any] = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$comment": "Generated from the pydantic model; regenerate with `nox -s prd`.",
        **model.model_json_schema(),
    }
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def write_schemas(schema_dir: Path) -> list[Path]:
    schema_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, model in registered_models().items():
        path = schema_dir / name
        path.write_text(render(model), encoding="utf-8")
        written.append(path)
    return written


def stale_schemas(schema_dir: Path) -> list[str]:
    """Schema files that are missing or differ from what the models generate now."""
    stale = []
    for name, model in registered_models().items():
        path = schema_dir / name
        if not path.is_file() or path.read_text(encoding="utf-8") != render(model):
            stale.append(name)
    return stale
