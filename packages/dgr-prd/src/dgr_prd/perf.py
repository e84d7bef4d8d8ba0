"""docs/perf.md, the performance log: every bench run's headline numbers over time, generated
from the bench log (evidence/bench/history.jsonl, one line per run, appended by
dgr_records.write_bench) as a projection (`nox -s prd` writes it, `dgr-prd validate` finds it
stale). `dgr-prd perf --backfill` rebuilds the log's early part from the git history of
evidence/bench/*.json (the runs committed before the log existed)."""

from __future__ import annotations

import json
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dgr_records import HISTORY, history_line

from dgr_prd.paths import RepoPaths

EARLIER = 10  # earlier values shown per metric


def read_history(path: Path) -> list[dict[str, Any]]:
    """The log's runs in time order, each once (a run logged twice counts once)."""
    if not path.is_file():
        return []
    runs: dict[tuple[str, str], dict[str, Any]] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            run = json.loads(line)
            key = (str(run["bench"]), str(run["measured_utc"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a bench run ({exc})") from exc
        runs[key] = run
    return sorted(runs.values(), key=lambda r: (r["measured_utc"], r["bench"]))


def backfill(paths: RepoPaths) -> list[dict[str, Any]]:
    """Every committed version of each evidence/bench/*.json, as the log's lines (oldest first):
    the commit it names if it names one, else the commit that added it; its measurement time,
    else that commit's date."""
    lines: list[dict[str, Any]] = []
    for path in sorted((paths.evidence / "bench").glob("*.json")):
        rel = str(path.relative_to(paths.root))
        log = subprocess.run(
            ["git", "log", "--reverse", "--format=%H %cI", "--", rel],
            cwd=paths.root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
        for entry in filter(None, log):
            commit, date = entry.split()
            shown = subprocess.run(
                ["git", "show", f"{commit}:{rel}"], cwd=paths.root, capture_output=True, text=True
            )
            try:
                data = json.loads(shown.stdout) if shown.returncode == 0 else None
            except ValueError:
                data = None
            if not isinstance(data, dict):
                continue
            line = history_line(path.stem, data, source=f"git {commit[:12]}")
            line["commit"] = line["commit"] or commit
            if "measured_utc" not in data:
                when = datetime.fromisoformat(date).astimezone(UTC)
                line["measured_utc"] = when.strftime("%Y-%m-%dT%H:%M:%SZ")
            lines.append(line)
    return lines


def _value(v: float) -> str:
    return f"{v:.4g}"


def render_perf(paths: RepoPaths) -> str:
    runs = read_history(paths.evidence / "bench" / HISTORY)
    lines = [
        "# Performance log",
        "",
        "Generated from `evidence/bench/history.jsonl` by `nox -s prd`: do not edit. One line per",
        "bench run (each bench's latest result with its rows is `evidence/bench/<bench>.json`, "
        "shown on the Benchmarks page); every ratio compares with a reference measured in the "
        "same run. Values are the headline numbers the gates read, oldest first; `cores` is the "
        "host's (the gate's host condition, prd.json `compute_threads`).",
        "",
    ]
    if not runs:
        return "\n".join([*lines, "No bench run logged yet.", ""])
    by_bench: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_bench.setdefault(run["bench"], []).append(run)
    for bench, its in sorted(by_bench.items()):
        latest = its[-1]
        commit = (latest.get("commit") or "?")[:10]
        lines += [
            f"## {bench}",
            "",
            f"{len(its)} run(s); latest {latest['measured_utc']} at `{commit}`"
            f"{' (dirty tree)' if latest.get('dirty') else ''}, "
            f"{latest.get('cores') or '?'} cores ({latest.get('cpu') or 'CPU not recorded'}).",
            "",
        ]
        names = sorted({k for r in its for k in r["metrics"]})
        if names:
            lines += ["| metric | latest | earlier runs |", "|---|---|---|"]
            for name in names:
                values = [r["metrics"][name] for r in its if name in r["metrics"]]
                earlier = " · ".join(_value(v) for v in values[:-1][-EARLIER:])
                more = len(values) - 1 - EARLIER
                lines.append(
                    f"| `{name}` | {_value(values[-1])} | "
                    f"{'… ' if more > 0 else ''}{earlier or '-'} |"
                )
            lines.append("")
        lines += ["| run (UTC) | commit | cores |", "|---|---|---|"]
        for r in its[-EARLIER:]:
            dirty = " (dirty)" if r.get("dirty") else ""
            lines.append(
                f"| {r['measured_utc']} | `{(r.get('commit') or '?')[:10]}`{dirty} | "
                f"{r.get('cores') or '?'} |"
            )
        lines.append("")
    return "\n".join(lines)
