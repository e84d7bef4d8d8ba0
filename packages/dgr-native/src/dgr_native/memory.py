"""bench-memory: each stage of a split in its own process, RSS next to what it should hold.

Per stage: the tensor bytes it owns (range subset of the manifest), its KV bytes and compute
buffers (llama.cpp's memory breakdown), and its RSS after a real prefill through the chain. The
fixed runtime overhead is what every stage of this model holds whatever its range: the
interpreter, numpy, the engine module and libllama, and the model's metadata and vocabulary; a
separate process measures it (loading the vocabulary alone).
Target: RSS <= 1.15 x (weights + KV + compute) + overhead.

The estimate (DGR-058) is made before anything loads: llama.cpp's own dry run over the range
(`estimate_only`: metadata, tensor shapes and the buffers the context would reserve, nothing
allocated) gives weights, KV and compute per stage; the manifest's range subset cross-checks the
weights. The bench compares every stage's measured RSS against that estimate.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from dgr_records import report, write_bench

TARGET_RATIO = 1.15
PROMPT_TOKENS = 128
STAGE_OPTIONS: dict[str, int] = {"n_threads": 2, "n_ctx": 512, "n_batch": 512, "max_sessions": 1}


def estimate_range(model: Path, first: int, last: int, **options: int) -> dict[str, int]:
    """Bytes a stage over [first, last) will hold, from llama.cpp's dry run (nothing allocated):
    weights, KV (and other per-layer state) and compute buffers."""
    from dgr_native import load

    d = load().Engine(str(model), first, last, estimate_only=True, **options).describe()
    return {
        "weights": int(d["weight_bytes"]),
        "kv": int(d["kv_bytes"]),
        "compute": int(d["compute_bytes"]),
        "per_kv_token": int(d["kv_bytes"])
        // (options.get("n_ctx", 2048) * options.get("max_sessions", 4)),
    }


def rss_bytes() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    return values["VmRSS"], values["VmHWM"]


def stage_main(model: str, first: int, last: int, boundary_in: str, boundary_out: str) -> None:
    """Run in a child process: one stage, one prefill; prints a JSON line."""
    import numpy as np

    from dgr_native import load

    engine_module = load()
    if first < 0:  # the fixed-overhead probe: interpreter, libraries, metadata and vocabulary
        vocabulary = engine_module.Vocabulary(model)  # what a stage holds whatever its range
        print(json.dumps({"overhead": rss_bytes()[0]}))
        del vocabulary
        return
    engine = engine_module.Engine(model, first, last, **STAGE_OPTIONS)
    d = engine.describe()
    if d["is_head"]:
        tokens = np.arange(1000, 1000 + PROMPT_TOKENS, dtype=np.int32)
        out = engine.forward(1, 1, 0, tokens=tokens)
    else:
        out = engine.forward(1, 1, 0, boundary=np.load(boundary_in))
    if not d["is_tail"]:
        np.save(boundary_out, out)
    rss, hwm = rss_bytes()
    print(json.dumps({"rss": rss, "hwm": hwm, "kv": d["kv_bytes"], "compute": d["compute_bytes"]}))


def run(model_name: str, n_stages: int) -> list[dict[str, Any]]:
    from dgr_artifacts.manifest import build_manifest
    from dgr_artifacts.models import model_path
    from dgr_artifacts.subset import range_subset
    from dgr_route.local import even_layout

    from dgr_native import load

    model = model_path(model_name)
    manifest = build_manifest(model)
    load()  # build once before the children import it
    rows = []

    def child(first: int, last: int, b_in: str, b_out: str) -> dict[str, int]:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "dgr_native.memory",
                "--stage",
                str(model),
                str(first),
                str(last),
                b_in,
                b_out,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        parsed: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
        return parsed

    overhead = child(-1, -1, "-", "-")["overhead"]
    with tempfile.TemporaryDirectory(prefix="dgr-memory-") as tmp:
        for i, (first, last) in enumerate(even_layout(manifest.n_layer, n_stages)):
            estimate = estimate_range(model, first, last, **STAGE_OPTIONS)
            stage = child(first, last, f"{tmp}/b{i}.npy", f"{tmp}/b{i + 1}.npy")
            weights = range_subset(manifest, first, last).total_bytes
            expected = estimate["weights"] + estimate["kv"] + estimate["compute"]
            rows.append(
                {
                    "stage": i,
                    "layers": [first, last],
                    "owned_weight_bytes": weights,
                    "estimated_weight_bytes": estimate["weights"],
                    "estimated_kv_bytes_per_token": estimate["per_kv_token"],
                    "kv_bytes": estimate["kv"],
                    "compute_bytes": estimate["compute"],
                    "measured_kv_bytes": stage["kv"],
                    "measured_compute_bytes": stage["compute"],
                    "overhead_bytes": overhead,
                    "rss_bytes": stage["rss"],
                    "peak_rss_bytes": stage["hwm"],
                    "rss_over_estimate": (stage["rss"] - overhead) / expected,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--stage":
        stage_main(args[1], int(args[2]), int(args[3]), args[4], args[5])
        return 0
    parser = argparse.ArgumentParser(prog="python -m dgr_native.memory")
    parser.add_argument("--model", default="smollm2-135m-q4_1")
    parser.add_argument("--stages", type=int, default=3)
    ns = parser.parse_args(args)
    rows = run(ns.model, ns.stages)
    mib = 2**20
    print(
        f"{'stage':<6}{'layers':<10}{'weights':>9}{'KV':>8}{'compute':>9}{'overhead':>10}"
        f"{'RSS':>8}{'peak':>8}{'ratio':>7}   (MiB; ratio = (RSS-overhead)/(w+KV+compute))"
    )
    for r in rows:
        print(
            f"{r['stage']:<6}{r['layers']!s:<10}{r['owned_weight_bytes'] / mib:>9.1f}"
            f"{r['kv_bytes'] / mib:>8.1f}{r['compute_bytes'] / mib:>9.1f}"
            f"{r['overhead_bytes'] / mib:>10.1f}{r['rss_bytes'] / mib:>8.1f}"
            f"{r['peak_rss_bytes'] / mib:>8.1f}{r['rss_over_estimate']:>7.3f}"
        )
    worst = max(r["rss_over_estimate"] for r in rows)
    result = {
        "model": ns.model,
        "stages": rows,
        "rss_over_estimate": round(worst, 4),
        "target": TARGET_RATIO,
        "meets_target": worst <= TARGET_RATIO,
    }
    write_bench(f"bench-memory-{ns.model}", result)
    report(
        "memory",
        {
            "rss_over_estimate": result["rss_over_estimate"],
            **{f"stage{r['stage']}_rss_mib": round(r["rss_bytes"] / mib, 1) for r in rows},
        },
    )
    print(f"worst ratio {worst:.3f} (target <= {TARGET_RATIO})")
    return 0 if worst <= TARGET_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
