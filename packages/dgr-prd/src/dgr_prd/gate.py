"""`dgr-prd gate alpha`: a gate's pre-locked thresholds (prd.json) against the newest evidence.

A metric named `section.key` is read from the newest place that reports it: a story run's
command metrics (`evidence/DGR-0NN/<run>/evidence.json`, `{section: {key: value}}`) or a bench's
own file (`evidence/bench/*.json`, whose `gate_metrics` holds `{section: {key: value}}` and
`measured_utc` says when). A threshold without evidence is a miss, never a pass.
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from dgr_prd.evidence import latest_decisive_record
from dgr_prd.model import Prd
from dgr_prd.paths import RepoPaths

OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "==": operator.eq,
}


@dataclass(frozen=True)
class Measurement:
    value: float
    source: str
    when: datetime


@dataclass(frozen=True)
class GateRow:
    metric: str
    op: str
    threshold: float
    meaning: str
    measured: Measurement | None

    @property
    def passed(self) -> bool:
        if self.measured is None or math.isnan(self.measured.value):
            return False
        return OPS[self.op](self.measured.value, self.threshold)

    @property
    def verdict(self) -> str:
        if self.measured is None:
            return "MISS: no evidence"
        if self.passed:
            return "pass"
        gap = abs(self.measured.value - self.threshold)
        return f"MISS by {gap:.3g}"


def _collect(into: dict[str, Measurement], metrics: object, source: str, when: datetime) -> None:
    if not isinstance(metrics, dict):
        return
    for section, values in metrics.items():
        if not isinstance(values, dict):
            continue
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            name = f"{section}.{key}"
            if name not in into or into[name].when < when:
                into[name] = Measurement(float(value), source, when)


def measurements(paths: RepoPaths, prd: Prd) -> dict[str, Measurement]:
    found: dict[str, Measurement] = {}
    for story in prd.stories:
        record = latest_decisive_record(paths.evidence, story.id)
        if record is None:
            continue
        when = datetime.fromisoformat(record.finished_utc.replace("Z", "+00:00"))
        for command in record.commands:
            source = f"{story.id} {record.run_id} ({command.name})"
            _collect(found, command.metrics, source, when)
    for path in sorted((paths.evidence / "bench").glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and "gate_metrics" in data and "measured_utc" in data:
            when = datetime.fromisoformat(str(data["measured_utc"]).replace("Z", "+00:00"))
            _collect(found, data["gate_metrics"], f"evidence/bench/{path.name}", when)
    return found


def evaluate(paths: RepoPaths, prd: Prd, gate_id: str) -> list[GateRow]:
    gates = {g.id.value: g for g in prd.gates}
    if gate_id not in gates:
        raise KeyError(f"no gate {gate_id!r} in prd.json (gates: {', '.join(gates)})")
    found = measurements(paths, prd)
    return [
        GateRow(t.metric, t.op, t.value, t.meaning, found.get(t.metric))
        for t in gates[gate_id].thresholds
    ]


def table(rows: list[GateRow]) -> list[str]:
    """The gate as a markdown table: threshold, measured value, verdict and where it came from."""
    lines = [
        "| metric | threshold | measured | verdict | evidence |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        measured = f"{r.measured.value:.4g}" if r.measured else "-"
        source = f"{r.measured.source}, {r.measured.when:%Y-%m-%d %H:%M} UTC" if r.measured else "-"
        lines.append(
            f"| `{r.metric}` | {r.op} {r.threshold:g} | {measured} | {r.verdict} | {source} |"
        )
    return lines
