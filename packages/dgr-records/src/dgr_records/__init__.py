"""How DGR's commands record what they measured.

- `report`: a story run's metrics, merged into the JSON file named by $DGR_METRICS (nothing when
  unset, so any command may call it);
- `write_bench`: a bench's result as evidence/bench/<name>.json in the checkout (what the gates and
  the evidence site read), or as the file a command was told to write, with the host it ran on
  and the commit it measured;
- `cpu_info` and `git_state`: that host and that commit;
- `headline`: the numbers of a bench's result that its log keeps (evidence/bench/history.jsonl,
  one line per run written into the checkout, from which docs/perf.md is generated).

The runtime's benches (`dgr bench`) and the planner's probes use this without the planning
package (dgr-prd), which reads the same records."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

HISTORY = "history.jsonl"  # the bench log, beside the benches' latest results

# Flags that change which kernels llama.cpp builds or can run (see FACTS.md on AMX).
NOTABLE_CPU_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "neon",
    "asimd",
    "sve",
)


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


def checkout(start: Path | None = None) -> Path | None:
    """The DGR checkout at or above `start` (default: cwd): the nearest directory holding
    prd.json, or $DGR_REPO_ROOT when set (tests run the tools on a copy); None outside one."""
    env = os.environ.get("DGR_REPO_ROOT")
    if env:
        return Path(env).resolve()
    here = (start or Path.cwd()).resolve()
    return next((c for c in (here, *here.parents) if (c / "prd.json").is_file()), None)


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The CPU: model, architecture, logical cores, a hash of its flags and the notable ones."""
    model = platform.processor() or platform.machine()
    flags: list[str] = []
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Hardware", "cpu model") and value.strip():
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = value.split()
    return {
        "model": model,
        "arch": platform.machine(),
        "cores": os.cpu_count() or 1,
        "flags_sha256": hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16],
        "notable_flags": [f for f in NOTABLE_CPU_FLAGS if f in flags],
    }


def git_state(root: Path) -> dict[str, Any]:
    """The commit checked out at `root` and whether the tree differs from it: {commit, dirty}
    (commit None where `root` is no git work tree or git is missing)."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=30, check=False
            )
        except OSError:
            return None
        return out.stdout if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain")
    return {"commit": commit.strip() if commit else None, "dirty": bool(status and status.strip())}


def headline(result: dict[str, Any]) -> dict[str, float]:
    """The numbers a bench's log keeps: what its gates read (`gate_metrics`, one section's keys
    bare, several as `section.key`), else its top-level numbers (flags and counts of nothing
    left out, and a stated target, which is no measurement)."""
    gates = result.get("gate_metrics")
    if isinstance(gates, dict) and gates:
        single = len(gates) == 1
        return {
            (key if single else f"{section}.{key}"): float(value)
            for section, values in gates.items()
            if isinstance(values, dict)
            for key, value in values.items()
            if isinstance(value, int | float) and not isinstance(value, bool)
        }
    return {
        key: float(value)
        for key, value in result.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and key != "target"
    }


def history_line(name: str, result: dict[str, Any], source: str = "write_bench") -> dict[str, Any]:
    """One run of bench `name` as its log keeps it: when, which commit and host, the headline."""
    git = result.get("git") or {}
    cpu = (result.get("host") or {}).get("cpu") or {}
    return {
        "bench": name,
        "measured_utc": result.get("measured_utc")
        or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": git.get("commit"),
        "dirty": git.get("dirty"),
        "cores": cpu.get("cores") or result.get("cores"),
        "cpu": cpu.get("model"),
        "source": source,
        "metrics": headline(result),
    }


def write_bench(name: str, result: dict[str, Any], out: Path | None = None) -> Path:
    """Write a bench's result, with the host it ran on (the CPU and its cores, the gate's host
    condition) and the commit it measured, to `out` or else the checkout's
    evidence/bench/<name>.json, there also appending its headline to the bench log
    (evidence/bench/history.jsonl); returns the path. Outside a checkout `out` is required."""
    root = checkout()
    log = None
    if out is None:
        if root is None:
            raise FileNotFoundError(
                f"no DGR checkout at or above {Path.cwd()} to hold evidence/bench/{name}.json: "
                "name the file to write"
            )
        out = root / "evidence" / "bench" / f"{name}.json"
        log = out.parent / HISTORY
    result.setdefault("host", {"cpu": cpu_info()})
    if root is not None:
        result.setdefault("git", git_state(root))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if log is not None:
        with log.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(history_line(name, result), sort_keys=True) + "\n")
    return out
