"""How evidence commands report metrics: a JSON object in the file named by $DGR_METRICS, and
the benches' results in evidence/bench/ (what the gates and the site read)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def report(section: str, values: dict[str, Any]) -> Path | None:
    """Merge `values` under `section` into the story runner's metrics file, if one is set.

    Commands outside a story run (no $DGR_METRICS) report nothing, so tools can call this freely.
    """
    target = os.environ.get("DGR_METRICS")
    if not target:
        return None
    path = Path(target)
    data: dict[str, Any] = {}
    if path.is_file() and path.stat().st_size:
        loaded = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(loaded, dict):
            data = loaded
    data.setdefault(section, {}).update(values)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def write_bench(name: str, result: dict[str, Any]) -> Path:
    """Write a bench's result to evidence/bench/<name>.json, with the host it ran on (the CPU and
    its cores, the gate's host condition) and the commit it measured; returns the path."""
    from dgr_prd.hardware import cpu_info
    from dgr_prd.paths import find_root
    from dgr_prd.runner import git_state

    root = find_root()
    result.setdefault("host", {"cpu": cpu_info()})
    result.setdefault("git", git_state(root.root).model_dump(mode="json"))
    out = root.evidence / "bench"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
