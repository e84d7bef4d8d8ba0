"""How evidence commands report metrics: a JSON object in the file named by $DGR_METRICS."""

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
