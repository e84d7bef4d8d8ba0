"""`dgr-prd gate alpha`: a gate's pre-locked thresholds (prd.json) against the newest evidence.

A metric named `section.key` is read from the newest place that reports it: a story run's
command metrics (`evidence/DGR-0NN/<run>/evidence.json`, `{section: {key: value}}`) or a bench's
own file (`evidence/bench/*.json`, whose `gate_metrics` holds `{section: {key: value}}` and
`measured_utc` says when). A threshold without evidence is a miss, never a pass.

The host condition: a threshold with `compute_threads` is measurable only where the evidence's
host had at least that many cores (the compute threads the row runs at once, each stage on its
own); measured on a smaller host, or on one the evidence does not name, it is
`not_measurable_here` with the reason, never a pass. Every measurement carries where it came
from: the record or file, its commit and dirty flag, and its host (cores, CPU model, lane).
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, replace
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
class Host:
    cores: int | None
    cpu: str
    lane: str


@dataclass(frozen=True)
class Measurement:
    value: float
    source: str
    when: datetime
    host: Host | None = None
    commit: str = ""
    dirty: bool | None = None


@dataclass(frozen=True)
class GateRow:
    metric: str
    op: str
    threshold: float
    meaning: str
    measured: Measurement | None
    compute_threads: int | None = None

    @property
    def unmeasurable(self) -> str | None:
        """Why the evidence's host cannot measure this row (the host condition), or None."""
        if self.compute_threads is None or self.measured is None:
            return None
        host = self.measured.host
        if host is None or host.cores is None:
            return f"needs {self.compute_threads} cores; the evidence does not record its host"
        if host.cores < self.compute_threads:
            return (
                f"needs {self.compute_threads} cores for {self.compute_threads} compute threads "
                f"at once; the host had {host.cores}"
            )
        return None

    @property
    def passed(self) -> bool:
        if self.measured is None or math.isnan(self.measured.value) or self.unmeasurable:
            return False
        return OPS[self.op](self.measured.value, self.threshold)

    @property
    def verdict(self) -> str:
        if self.measured is None:
            return "MISS: no evidence"
        if why := self.unmeasurable:
            return f"not_measurable_here: {why}"
        if self.passed:
            return "pass"
        gap = abs(self.measured.value - self.threshold)
        return f"MISS by {gap:.3g}"


def _collect(into: dict[str, Measurement], metrics: object, origin: Measurement) -> None:
    """Every `section.key` number of `metrics`, measured where `origin` says (its value unused)."""
    if not isinstance(metrics, dict):
        return
    for section, values in metrics.items():
        if not isinstance(values, dict):
            continue
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            name = f"{section}.{key}"
            if name not in into or into[name].when < origin.when:
                into[name] = replace(origin, value=float(value))


def _host(hardware: object, lane: str) -> Host | None:
    if not isinstance(hardware, dict) or not isinstance(hardware.get("cpu"), dict):
        return None
    cpu = hardware["cpu"]
    cores = cpu.get("cores")
    return Host(cores if isinstance(cores, int) else None, str(cpu.get("model", "?")), lane)


def measurements(paths: RepoPaths, prd: Prd) -> dict[str, Measurement]:
    found: dict[str, Measurement] = {}
    for story in prd.stories:
        record = latest_decisive_record(paths.evidence, story.id)
        if record is None:
            continue
        when = datetime.fromisoformat(record.finished_utc.replace("Z", "+00:00"))
        for command in record.commands:
            origin = Measurement(
                math.nan,
                f"evidence/{story.id}/{record.run_id} ({command.name})",
                when,
                _host(record.hardware, command.lane),
                record.git.commit or "",
                record.git.dirty,
            )
            _collect(found, command.metrics, origin)
    for path in sorted((paths.evidence / "bench").glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and "gate_metrics" in data and "measured_utc" in data:
            when = datetime.fromisoformat(str(data["measured_utc"]).replace("Z", "+00:00"))
            git: dict[str, object] = data["git"] if isinstance(data.get("git"), dict) else {}
            origin = Measurement(
                math.nan,
                f"evidence/bench/{path.name}",
                when,
                _host(data.get("host"), str(data.get("lane", "cpu"))),
                str(git.get("commit", "")),
                dirty if isinstance(dirty := git.get("dirty"), bool) else None,
            )
            _collect(found, data["gate_metrics"], origin)
    return found


def evaluate(paths: RepoPaths, prd: Prd, gate_id: str) -> list[GateRow]:
    gates = {g.id.value: g for g in prd.gates}
    if gate_id not in gates:
        raise KeyError(f"no gate {gate_id!r} in prd.json (gates: {', '.join(gates)})")
    found = measurements(paths, prd)
    return [
        GateRow(t.metric, t.op, t.value, t.meaning, found.get(t.metric), t.compute_threads)
        for t in gates[gate_id].thresholds
    ]


def host_text(m: Measurement | None) -> str:
    if m is None or m.host is None:
        return "-"
    cores = "?" if m.host.cores is None else str(m.host.cores)
    return f"{cores} cores, {m.host.cpu}, {m.host.lane}"


def tree_text(dirty: bool | None) -> str:
    return "-" if dirty is None else ("dirty" if dirty else "clean")


def table(rows: list[GateRow]) -> list[str]:
    """The gate as a markdown table: threshold, measured value, verdict and where it came from
    (the evidence and when, its commit and tree, its host); `gate` and `gate-review` print it."""
    lines = [
        "| metric | threshold | measured | verdict | evidence | commit | tree | host |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r.measured
        measured = f"{m.value:.4g}" if m else "-"
        source = f"{m.source}, {m.when:%Y-%m-%d %H:%M} UTC" if m else "-"
        commit = m.commit[:12] if m and m.commit else "-"
        lines.append(
            f"| `{r.metric}` | {r.op} {r.threshold:g} | {measured} | {r.verdict} | {source} | "
            f"{commit} | {tree_text(m.dirty) if m else '-'} | {host_text(m)} |"
        )
    return lines
