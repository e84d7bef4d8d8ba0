"""Parity over generated layouts (stories DGR-059 and, on the V4 twin, DGR-065).

Layouts come from the scenario generator (`dgr_native.scenarios`): per stage count an even
split, then the model's fragile seams (for DeepSeek V4: inside the hash-routed block, around a
ratio-128 layer, after the hash block), then a seeded random split. The prompt is seeded random
token ids, longer than 128 tokens by default so V4's CSA and HCA compressors emit blocks. For
every layout and model:

- in process: a chain of ShardEngines against the whole model in one engine (same build, same
  batch shape), f32 boundary (bitwise) and bf16 boundary (NMSE, top-1 and top-5 agreement);
- over workers (`--workers`): one `dgr-shard-worker` process per stage on loopback and a Route
  whose tail returns each step's logits; they must equal the reference bit for bit, and the
  bytes that crossed each seam per token are counted. One more run per layout decodes with
  prompt-lookup drafts (speculative decoding) from a prompt that says its first third three
  times, against that prompt's single-process reference: the same greedy tokens (required) and
  whether the logits are bitwise equal too, with the drafts verified and kept counted. On a
  model with an MTP block (the V4 twins) the tail worker serves it (`--mtp`) in every run, and
  one more run decodes that prompt with the tail's MTP drafts, under the same requirement.

`nox -s parity -- --distributed --model dsv4-twin --stages 2 3 4 11 --workers`
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
from dgr_cli.workers import descriptor_args, start_worker
from dgr_native.parity import ParityResult, compare, reference_run, top_k_overlap
from dgr_native.scenarios import ModelStructure, Scenario, generate
from dgr_records import report
from dgr_route.local import Chain
from dgr_route.route import Draft, DraftUsage, Route
from dgr_wire.codec import REAL_V4, seam_bytes

DEFAULT_MODELS = ["smollm2-135m-q4_1", "dsv4-twin-quick"]
LOOKUP_DECODE = 48  # decode steps of the prompt-lookup run
# A drafted run must give one process's greedy tokens. Where it does not, the report says whether
# the divergence looks like a rounding tie: the route's logits up to that step within this NMSE
# of the reference's (what verifying V4 rows in one batch rounded, up to ~1e-3, before V4 stages
# verified row by row; a wrong cache or rollback gives order 1), with the reference's margin of
# its token over the route's there. A diagnosis only: any divergence fails.
TIE_NMSE = 1e-2


@dataclass
class Run:
    """One route run over a layout's workers: its mode and wire dtype, the logits it must equal,
    and for speculative decoding the draft source and its own prompt."""

    mode: str
    wire_dtype: str
    ref_logits: list[np.ndarray]
    draft: str = "off"
    prompt: np.ndarray | None = None  # None: the layout's prompt


@dataclass
class WorkerResult:
    scenario: str
    mode: str  # forward (stage to stage) or relay (through the coordinator)
    wire_dtype: str
    layout: list[tuple[int, int]]
    steps: int
    bitwise_equal: bool
    max_abs_diff: float
    top5_overlap: float
    greedy_identical: bool
    seam_bytes_per_token: dict[str, float]  # measured in relay mode (it passes the coordinator)
    seconds: float
    draft: str = "off"  # speculative decoding: drafts verified and accepted on the way
    drafted: int = 0
    accepted: int = 0
    # where the greedy tokens first differ from the reference (None: nowhere), the reference's
    # margin of its token over the route's there, and the largest NMSE of the route's logits up
    # to that step
    first_divergence: int | None = None
    divergence_margin: float = 0.0
    nmse_to_divergence: float = 0.0

    @property
    def tie(self) -> bool:
        """Greedy tokens that differ only where rounding decided a near-tie (see TIE_NMSE)."""
        return self.first_divergence is not None and self.nmse_to_divergence <= TIE_NMSE


def structure(model: Path) -> tuple[ModelStructure, bool]:
    """The model's layer structure for the scenario generator, and whether it carries an MTP
    (nextn) block a tail can serve."""
    from dgr_artifacts.identity import open_model

    kv = open_model(model).kv
    arch = kv["general.architecture"]
    blocks = int(kv[f"{arch}.block_count"])
    nextn = int(kv.get(f"{arch}.nextn_predict_layers", 0))
    ratios = kv.get(f"{arch}.attention.compress_ratios", [])
    if isinstance(ratios, int | float):  # llama.cpp's saver writes one value for every layer
        ratios = [ratios] * blocks
    shape = ModelStructure(
        n_layer=blocks - nextn,
        hash_layers=int(kv.get(f"{arch}.hash_layer_count", 0)),
        compress_ratios=tuple(int(r) for r in ratios),
    )
    return shape, nextn > 0


def free_run(
    model: Path, layout: list[tuple[int, int]], dtype: str, prompt: np.ndarray, steps: int
) -> list[np.ndarray]:
    """A chain in one process generating greedily from its own logits (what a route does)."""
    logits, _ = Chain(model, layout, dtype).greedy(prompt, steps)
    return logits


def over_workers(
    model: Path, scenario: Scenario, prompt: np.ndarray, runs: list[Run], mtp: bool = False
) -> list[WorkerResult]:
    """For each run: the route's logits against its reference (the single-process run for an
    f32 wire, the same layout in one process with the same rounding for f16/bf16), over one set
    of workers (the tail serving the model's MTP block when `mtp`)."""
    descriptor = descriptor_args(model)
    workers = []
    results = []
    try:
        for i, (a, b) in enumerate(scenario.layout):
            tail_mtp = ["--mtp"] if mtp and i == len(scenario.layout) - 1 else []
            workers.append(
                start_worker(model, a, b, descriptor=descriptor, n_ctx=1024, extra=tail_mtp)
            )
        for run in runs:
            t0 = time.perf_counter()
            route = Route.open(
                [w.address for w in workers],
                wire_dtype=run.wire_dtype,
                mode=run.mode,
                draft=Draft(run.draft),
            )
            tokens = prompt if run.prompt is None else run.prompt
            usage = DraftUsage()
            try:
                trace = list(route.trace([int(t) for t in tokens], len(run.ref_logits), usage))
            finally:
                route.close()
            got = np.stack([logits for _, logits in trace])
            want = np.stack(run.ref_logits)
            route_tokens = [t for t, _ in trace]
            ref_tokens = [int(np.argmax(x)) for x in run.ref_logits]
            first = next(
                (
                    i
                    for i, (a, b) in enumerate(zip(route_tokens, ref_tokens, strict=True))
                    if a != b
                ),
                None,
            )
            upto = len(trace) if first is None else first + 1
            results.append(
                WorkerResult(
                    scenario=scenario.name,
                    mode=run.mode,
                    wire_dtype=run.wire_dtype,
                    layout=scenario.layout,
                    steps=len(trace),
                    bitwise_equal=bool(np.array_equal(got.view(np.uint32), want.view(np.uint32))),
                    max_abs_diff=float(np.max(np.abs(got - want))),
                    top5_overlap=top_k_overlap(got, want, 5),
                    greedy_identical=first is None,
                    seam_bytes_per_token=route.wire.per_token(),
                    seconds=time.perf_counter() - t0,
                    draft=run.draft,
                    drafted=usage.drafted,
                    accepted=usage.accepted,
                    first_divergence=first,
                    divergence_margin=0.0
                    if first is None
                    else float(want[first, ref_tokens[first]] - want[first, route_tokens[first]]),
                    nmse_to_divergence=max(nmse(got[i], want[i]) for i in range(upto)),
                )
            )
    finally:
        for w in workers:
            w.stop()
    return results


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    """Normalised mean squared error, as the in-process comparison computes it."""
    return float(np.mean((got - want) ** 2) / np.mean(want**2))


def drafted_cell(runs: list[WorkerResult], source: str) -> str:
    """A drafted run's verdict: bits (logits bitwise equal), tokens (the same greedy tokens,
    logits within rounding), tie@N (the tokens first differ at step N, a near-tie that rounding
    decided: see TIE_NMSE), NO (different tokens otherwise), and the drafts kept of those
    verified."""
    found = [r for r in runs if r.draft == source]
    if not found:
        return "-"
    run = found[0]
    verdict = (
        "bits"
        if run.bitwise_equal
        else "tokens"
        if run.greedy_identical
        else f"tie@{run.first_divergence}"
        if run.tie
        else "NO"
    )
    return f"{verdict} {run.accepted}/{run.drafted}"


def drafted_metrics(runs: list[WorkerResult], source: str) -> dict[str, Any]:
    """One draft source's runs over every layout: whether the greedy tokens equal one process's
    (required), and where not, whether every divergence looks like a rounding tie (`_explained`,
    a diagnosis); whether the logits are bitwise equal too (SmolLM2 verifies a step's rows in one
    batch with the same bits, a V4 stage row by row); and the drafts the tails kept of those they
    verified."""
    found = [w for w in runs if w.draft == source]
    return {
        f"workers_{source}_greedy_identical": all(w.greedy_identical for w in found)
        if found
        else None,
        f"workers_{source}_explained": all(w.greedy_identical or w.tie for w in found)
        if found
        else None,
        f"workers_{source}_ties": sum(w.tie for w in found),
        f"workers_{source}_tie_nmse_max": max(
            (w.nmse_to_divergence for w in found if w.tie), default=0.0
        ),
        f"workers_{source}_all_bitwise": all(w.bitwise_equal for w in found) if found else None,
        f"workers_{source}_max_abs_logit_diff": max((w.max_abs_diff for w in found), default=0.0),
        f"workers_{source}_drafted": sum(w.drafted for w in found),
        f"workers_{source}_accepted": sum(w.accepted for w in found),
    }


def certify(
    name: str,
    model: Path,
    stages: list[int],
    prompt_tokens: int,
    decode: int,
    seed: int,
    workers: bool,
) -> dict[str, Any]:
    from dgr_native import load

    shape, mtp = structure(model)
    scenarios = generate(shape, [k for k in stages if k <= shape.n_layer], seed)
    whole = load().Engine(str(model), n_ctx=1024).describe()
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, int(whole["n_vocab"]), prompt_tokens).astype(np.int32)
    prompt, ref_logits, ref_tokens = reference_run(model, decode, prompt)
    # speculative decoding's run: a third of the prompt said three times, so that prompt lookup
    # drafts, and decoding long enough for drafts to be both kept and rejected
    third = rng.integers(0, int(whole["n_vocab"]), prompt_tokens // 3).astype(np.int32)
    quoting, quote_logits, _ = reference_run(
        model, max(decode, LOOKUP_DECODE), np.concatenate([third, third, third])
    )
    print(
        f"\n{name}: {shape.n_layer} layers, {shape.hash_layers} hash-routed, "
        f"{len(scenarios)} generated layouts, prompt {len(prompt)} tokens + {decode} decode steps"
    )
    print(
        f"{'layout':<40}{'seams':<32}{'f32':>5}{'bf16 NMSE':>11}{'top1':>6}{'top5':>6}"
        f"{'forward':>9}{'relay':>7}{'lookup':>14}{'mtp':>14}{'bf16 wire':>10}{'B/tok/seam':>12}"
    )
    in_process: list[tuple[Scenario, ParityResult]] = []
    over: list[WorkerResult] = []
    for sc in scenarios:
        f32 = compare(model, sc.layout, "f32", prompt, ref_logits, ref_tokens)
        bf16 = compare(model, sc.layout, "bf16", prompt, ref_logits, ref_tokens)
        in_process += [(sc, f32), (sc, bf16)]
        runs: list[WorkerResult] = []
        if workers:
            bf16_ref = free_run(model, sc.layout, "bf16", prompt, len(ref_logits))
            runs = over_workers(
                model,
                sc,
                prompt,
                [
                    Run("forward", "f32", ref_logits),
                    Run("relay", "f32", ref_logits),
                    Run("forward", "bf16", bf16_ref),
                    Run("relay", "bf16", bf16_ref),
                    Run("forward", "f32", quote_logits, "lookup", quoting),
                    *([Run("forward", "f32", quote_logits, "mtp", quoting)] if mtp else []),
                ],
                mtp=mtp,
            )
            over += runs

        def cell(mode: str, dtype: str, runs: list[WorkerResult] = runs) -> str:
            found = [
                r for r in runs if r.mode == mode and r.wire_dtype == dtype and r.draft == "off"
            ]
            return ("yes" if found[0].bitwise_equal else "NO") if found else "-"

        relay = [r for r in runs if r.mode == "relay" and r.wire_dtype == "f32"]
        wire = sum(relay[0].seam_bytes_per_token.values()) if relay else 0
        bf16_equal = all(r.bitwise_equal for r in runs if r.wire_dtype == "bf16")
        print(
            f"{sc.name:<40}{','.join(map(str, sc.seams)):<32}"
            f"{'yes' if f32.bitwise_equal else 'NO':>5}{bf16.nmse:>11.2e}"
            f"{bf16.top1_agreement:>6.2f}{bf16.top5_overlap:>6.2f}"
            f"{cell('forward', 'f32'):>9}{cell('relay', 'f32'):>7}"
            f"{drafted_cell(runs, 'lookup'):>14}{drafted_cell(runs, 'mtp'):>14}"
            f"{('yes' if bf16_equal else 'NO') if runs else '-':>10}"
            f"{f'{wire:.0f}' if runs else '-':>12}",
            flush=True,
        )
    bf16_runs = [r for _, r in in_process if r.boundary_dtype == "bf16"]
    plain = [w for w in over if w.draft == "off"]
    by_worker = {(w.scenario, w.mode): w for w in plain if w.wire_dtype == "f32"}
    by_worker_bf16 = {(w.scenario, w.mode): w for w in plain if w.wire_dtype == "bf16"}
    per_layout: dict[str, dict[str, Any]] = {}
    for sc, r in in_process:
        entry = per_layout.setdefault(sc.name, {"seams": ",".join(map(str, sc.seams))})
        if r.boundary_dtype == "f32":
            entry["f32_max_abs_logit_diff"] = r.max_abs_diff
            entry["f32_greedy_identical"] = r.greedy_identical
        else:
            entry["bf16_nmse"] = r.nmse
            entry["bf16_top1"] = r.top1_agreement
            entry["bf16_top5"] = r.top5_overlap
        for mode in ("forward", "relay"):
            if (sc.name, mode) in by_worker:
                entry[f"workers_{mode}_max_abs_logit_diff"] = by_worker[sc.name, mode].max_abs_diff
                entry[f"workers_{mode}_greedy_identical"] = by_worker[
                    sc.name, mode
                ].greedy_identical
            if (sc.name, mode) in by_worker_bf16:
                entry[f"workers_{mode}_bf16_equal_in_process_bf16"] = by_worker_bf16[
                    sc.name, mode
                ].bitwise_equal
    twin = seam_bytes(int(whole["hc"]), int(whole["n_embd"]))
    metrics: dict[str, Any] = {
        "n_layer": shape.n_layer,
        "layouts": len(scenarios),
        "stage_counts": sorted({len(s.layout) for s in scenarios}),
        "prompt_tokens": len(prompt),
        "decode_steps": decode,
        "in_process_f32_all_bitwise": all(
            r.bitwise_equal for _, r in in_process if r.boundary_dtype == "f32"
        ),
        "in_process_f32_max_abs_logit_diff": max(
            r.max_abs_diff for _, r in in_process if r.boundary_dtype == "f32"
        ),
        "workers_checked": len(over),
        "workers_modes": sorted({w.mode for w in over}),
        "workers_all_bitwise": all(w.bitwise_equal and w.greedy_identical for w in plain)
        if plain
        else None,
        # speculative decoding over every layout: prompt lookup, and the tail's MTP block where
        # the model has one (the plain runs above then also ran with the tail serving it)
        **drafted_metrics(over, "lookup"),
        **(drafted_metrics(over, "mtp") if mtp else {}),
        "workers_tail_mtp": mtp if workers else None,
        "bf16_nmse_max": max(r.nmse for r in bf16_runs),
        "bf16_top1_min": min(r.top1_agreement for r in bf16_runs),
        "bf16_top5_min": min(r.top5_overlap for r in bf16_runs),
        "residual_bytes_per_token_per_seam": twin,
        "per_layout": per_layout,
    }
    line = (
        f"seam: {twin['f32']} B/token f32, {twin['bf16']} B/token bf16 "
        f"(hc {whole['hc']} x n_embd {whole['n_embd']})"
    )
    relayed = {w.wire_dtype: w.seam_bytes_per_token for w in plain if w.mode == "relay"}
    metrics["measured_wire_bytes_per_token_per_seam"] = relayed.get("f32")
    metrics["measured_wire_bytes_per_token_per_seam_bf16"] = relayed.get("bf16")
    if relayed:
        f32_wire, bf16_wire = relayed["f32"], relayed["bf16"]
        line += (
            f"; on the wire {f32_wire['boundary']:.0f} B (f32) or {bf16_wire['boundary']:.0f} B "
            f"(bf16) boundary message + {f32_wire['sideband']:.0f} B token ids per token per seam"
        )
    print(line)
    if int(whole["hc"]) > 1:
        real = seam_bytes(REAL_V4["hc"], REAL_V4["n_embd"])
        print(
            f"real DeepSeek V4: 4 x 4096 x 2 = {real['bf16']} B = {real['bf16'] // 1024} KiB per "
            f"token per seam in bf16 ({real['f32'] // 1024} KiB in f32), plus "
            f"{real['token_id_sideband']} B of token id for stages owning hash-routed layers"
        )
        metrics["real_v4_bytes_per_token_per_seam"] = real
    return {
        "metrics": metrics,
        "in_process": [{"scenario": sc.name, **asdict(r)} for sc, r in in_process],
        "workers": [asdict(w) for w in over],
    }


def main(argv: list[str] | None = None) -> int:
    from dgr_artifacts.models import model_names, model_path

    parser = argparse.ArgumentParser(prog="python -m dgr_cert.layout_parity")
    parser.add_argument("--model", action="append", choices=model_names())
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4, 11])
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", action="store_true", help="also run every layout over workers")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    results = {
        name: certify(
            name,
            model_path(name),
            args.stages,
            args.prompt_tokens,
            args.decode,
            args.seed,
            args.workers,
        )
        for name in (args.model or DEFAULT_MODELS)
    }
    report("layout_parity", {name: r["metrics"] for name, r in results.items()})
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    failed = [
        name
        for name, r in results.items()
        if not r["metrics"]["in_process_f32_all_bitwise"]
        or r["metrics"]["workers_all_bitwise"] is False
        or r["metrics"]["workers_lookup_greedy_identical"] is False
        or r["metrics"].get("workers_mtp_greedy_identical") is False
    ]
    for name in failed:
        print(
            f"PARITY FAILED: {name}: an f32 layout differs from the single-process run, or a "
            "drafted run's greedy tokens differ from it"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
