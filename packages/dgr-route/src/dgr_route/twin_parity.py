"""DeepSeek V4 seam certification on a generated twin (story DGR-065).

Layouts come from the scenario generator (`dgr_native.scenarios`): for 2, 3, 4 and 11 stages an
even split, seams inside the hash-routed block, around an HCA (ratio 128) layer and after the hash
block, and a seeded random split. The prompt is seeded random token ids, longer than 128 tokens
so that the CSA and HCA compressors emit blocks. For every layout:

- in process: a chain of ShardEngines against the whole model in one engine (same build, same
  batch shape), f32 boundary (bitwise) and bf16 boundary (NMSE, greedy agreement);
- over workers (`--workers`): one `dgr-shard-worker` process per stage on loopback and a Route
  that returns each step's logits; they must equal the reference bit for bit.

`python -m dgr_route.twin_parity --model dsv4-twin --workers --json out.json`
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from dgr_native.parity import ParityResult, compare, reference_run
from dgr_native.scenarios import ModelStructure, Scenario, generate
from dgr_prd.metrics import report

from dgr_route.route import Route
from dgr_route.workers import descriptor_args, start_worker

REAL_V4 = {"hc": 4, "n_embd": 4096}


@dataclass
class WorkerResult:
    scenario: str
    layout: list[tuple[int, int]]
    steps: int
    bitwise_equal: bool
    max_abs_diff: float
    greedy_identical: bool
    seconds: float


def structure(model: Path) -> ModelStructure:
    from dgr_artifacts.identity import open_model

    kv = open_model(model).kv
    arch = kv["general.architecture"]
    blocks = int(kv[f"{arch}.block_count"])
    nextn = int(kv.get(f"{arch}.nextn_predict_layers", 0))
    return ModelStructure(
        n_layer=blocks - nextn,
        hash_layers=int(kv.get(f"{arch}.hash_layer_count", 0)),
        compress_ratios=tuple(int(r) for r in kv.get(f"{arch}.attention.compress_ratios", [])),
    )


def over_workers(
    model: Path, scenario: Scenario, prompt: np.ndarray, ref_logits: list[np.ndarray]
) -> WorkerResult:
    t0 = time.perf_counter()
    descriptor = descriptor_args(model)
    workers = []
    try:
        for a, b in scenario.layout:
            workers.append(start_worker(model, a, b, descriptor=descriptor, n_ctx=1024))
        route = Route.open([w.address for w in workers])
        try:
            trace = list(route.trace([int(t) for t in prompt], len(ref_logits)))
        finally:
            route.close()
    finally:
        for w in workers:
            w.stop()
    got = np.stack([logits for _, logits in trace])
    want = np.stack(ref_logits)
    tokens = [t for t, _ in trace]
    return WorkerResult(
        scenario=scenario.name,
        layout=scenario.layout,
        steps=len(trace),
        bitwise_equal=bool(np.array_equal(got.view(np.uint32), want.view(np.uint32))),
        max_abs_diff=float(np.max(np.abs(got - want))),
        greedy_identical=tokens == [int(np.argmax(x)) for x in ref_logits],
        seconds=time.perf_counter() - t0,
    )


def seam_bytes(hc: int, n_embd: int) -> dict[str, int]:
    """Bytes per token crossing one seam: the residual in f32 and bf16, and the id sideband."""
    return {"f32": hc * n_embd * 4, "bf16": hc * n_embd * 2, "token_id_sideband": 4}


def main(argv: list[str] | None = None) -> int:
    from dgr_artifacts.models import model_names, model_path

    parser = argparse.ArgumentParser(prog="python -m dgr_route.twin_parity")
    parser.add_argument("--model", default="dsv4-twin", choices=model_names())
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4, 11])
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", action="store_true", help="also run every layout over workers")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    model = model_path(args.model)
    shape = structure(model)
    scenarios = generate(shape, args.stages, args.seed)
    rng = np.random.default_rng(args.seed)
    from dgr_native import load

    whole = load().Engine(str(model), n_ctx=1024).describe()
    prompt = rng.integers(0, int(whole["n_vocab"]), args.prompt_tokens).astype(np.int32)
    prompt, ref_logits, ref_tokens = reference_run(model, args.decode, prompt)
    print(
        f"{args.model}: {shape.n_layer} layers, hash-routed {shape.hash_layers}, "
        f"{len(scenarios)} generated layouts, prompt {len(prompt)} tokens + {args.decode} decode"
    )

    in_process: list[tuple[Scenario, ParityResult]] = []
    workers: list[WorkerResult] = []
    print(f"{'layout':<42}{'seams':<22}{'f32':>5}{'bf16 NMSE':>11}{'top1':>6}{'workers':>9}")
    for sc in scenarios:
        f32 = compare(model, sc.layout, "f32", prompt, ref_logits, ref_tokens)
        bf16 = compare(model, sc.layout, "bf16", prompt, ref_logits, ref_tokens)
        in_process += [(sc, f32), (sc, bf16)]
        w = over_workers(model, sc, prompt, ref_logits) if args.workers else None
        if w:
            workers.append(w)
        seams = ",".join(map(str, sc.seams))
        print(
            f"{sc.name:<42}{seams:<22}{'yes' if f32.bitwise_equal else 'NO':>5}"
            f"{bf16.nmse:>11.2e}{bf16.top1_agreement:>6.2f}"
            f"{('yes' if w.bitwise_equal else 'NO') if w else '-':>9}",
            flush=True,
        )

    twin_bytes = seam_bytes(int(whole["hc"]), int(whole["n_embd"]))
    real_bytes = seam_bytes(REAL_V4["hc"], REAL_V4["n_embd"])
    print(
        f"seam bytes per token: twin {twin_bytes['f32']} (f32) / {twin_bytes['bf16']} (bf16); "
        f"real V4 {real_bytes['bf16']} B = {real_bytes['bf16'] // 1024} KiB in bf16 "
        f"(4 x 4096 x 2), plus {real_bytes['token_id_sideband']} B of token id per stage that "
        "owns a hash-routed layer"
    )
    f32_ok = all(r.bitwise_equal for _, r in in_process if r.boundary_dtype == "f32")
    workers_ok = all(w.bitwise_equal and w.greedy_identical for w in workers)
    bf16_runs = [r for _, r in in_process if r.boundary_dtype == "bf16"]
    metrics: dict[str, Any] = {
        "model": args.model,
        "n_layer": shape.n_layer,
        "layouts": len(scenarios),
        "stage_counts": args.stages,
        "prompt_tokens": len(prompt),
        "decode_steps": args.decode,
        "in_process_f32_all_bitwise": f32_ok,
        "workers_checked": len(workers),
        "workers_all_bitwise": workers_ok if workers else None,
        "bf16_nmse_max": max(r.nmse for r in bf16_runs),
        "bf16_top1_min": min(r.top1_agreement for r in bf16_runs),
        "seam_bytes_per_token_twin": twin_bytes,
        "seam_bytes_per_token_real_v4": real_bytes,
    }
    report("twin_parity", metrics)
    if args.json:
        payload = {
            "metrics": metrics,
            "in_process": [{"scenario": sc.name, **asdict(r)} for sc, r in in_process],
            "workers": [asdict(w) for w in workers],
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    if not (f32_ok and workers_ok):
        print("PARITY FAILED: an f32 layout differs from the single-process run")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
