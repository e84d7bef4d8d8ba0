"""In-process parity: chains of ShardEngines (dgr_route.local.Chain) against the same llama.cpp
build running the whole model with the same batch shape (the prompt as one batch, then one token
per decode step).

The reference is one engine over [0, n_layer): with the full range the patch stack changes
nothing, so it is the same build's monolithic run. The chain is teacher-forced with the
reference's greedy tokens, so every step compares logits for the same input; a chain whose own
greedy choice would differ shows up as a top-1 disagreement.

`python -m dgr_native.parity` runs the layouts of the story (2, 3 and 5 stages, f32 and f16 on the
boundary) on the real models, prints a table, and reports metrics for the evidence.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from dgr_records import report
from dgr_route.local import ENGINE_OPTIONS, Chain, even_layout

from dgr_native import load

PROMPT = (
    "The history of distributed computing begins with the idea that one machine is never "
    "enough. Explain, step by step, how a large language model can be split across several "
    "computers so that each one holds only some of its layers, and what has to travel between "
    "them for every token."
)


@dataclass
class ParityResult:
    model: str
    layout: list[tuple[int, int]]
    boundary_dtype: str
    steps: int
    bitwise_equal: bool
    max_abs_diff: float
    nmse: float
    top1_agreement: float
    top5_overlap: float
    greedy_identical: bool
    boundary_bytes_per_token: int


def top_k_overlap(a: np.ndarray, b: np.ndarray, k: int) -> float:
    """Mean share of each row's top-k ids that two [steps, n_vocab] logit arrays agree on."""
    top_a = np.argsort(-a, axis=1, kind="stable")[:, :k]
    top_b = np.argsort(-b, axis=1, kind="stable")[:, :k]
    shared = [len(set(x) & set(y)) / k for x, y in zip(top_a.tolist(), top_b.tolist(), strict=True)]
    return float(np.mean(shared))


def reference_run(
    model: Path, n_decode: int, prompt: np.ndarray | None = None
) -> tuple[np.ndarray, list[np.ndarray], list[int]]:
    """The whole model's logits for the prompt (default: PROMPT tokenized) and n_decode greedy
    steps after it, with the greedy tokens."""
    ref = Chain(model, [(0, -1)])
    if prompt is None:
        prompt = ref.tokenize(PROMPT)
    logits, tokens = ref.greedy(prompt, n_decode + 1)
    return prompt, logits, tokens


def compare(
    model: Path,
    layout: Sequence[tuple[int, int]],
    dtype: str,
    prompt: np.ndarray,
    ref_logits: list[np.ndarray],
    ref_tokens: list[int],
) -> ParityResult:
    chain = Chain(model, layout, dtype)
    got = [chain.step(prompt)]
    for token in ref_tokens[:-1]:
        got.append(chain.step(np.array([token], dtype=np.int32)))
    a, b = np.stack(got), np.stack(ref_logits)
    top1 = float(np.mean(np.argmax(a, axis=1) == np.argmax(b, axis=1)))
    return ParityResult(
        model=model.stem,
        layout=[(a, b) for a, b in layout],
        boundary_dtype=dtype,
        steps=len(got),
        bitwise_equal=bool(np.array_equal(a.view(np.uint32), b.view(np.uint32))),
        max_abs_diff=float(np.max(np.abs(a - b))),
        nmse=float(np.mean((a - b) ** 2) / np.mean(b**2)),
        top1_agreement=top1,
        top5_overlap=top_k_overlap(a, b, 5),
        greedy_identical=top1 == 1.0,
        boundary_bytes_per_token=chain.boundary_bytes_per_token(),
    )


def run(
    models: dict[str, Path], stage_counts: list[int], n_decode: int, dtypes: list[str]
) -> list[ParityResult]:
    results = []
    for name, model in models.items():
        n_layer = int(load().Engine(str(model), **ENGINE_OPTIONS).describe()["n_layer"])
        prompt, ref_logits, ref_tokens = reference_run(model, n_decode)
        for n_stages in stage_counts:
            for dtype in dtypes:
                result = compare(
                    model, even_layout(n_layer, n_stages), dtype, prompt, ref_logits, ref_tokens
                )
                result.model = name
                results.append(result)
    return results


def print_table(results: list[ParityResult]) -> None:
    print(
        f"{'model':<20}{'stages':>7}{'dtype':>6}{'steps':>6}{'bitwise':>9}{'max|dl|':>11}"
        f"{'NMSE':>11}{'top1':>7}{'B/token':>9}"
    )
    for r in results:
        print(
            f"{r.model:<20}{len(r.layout):>7}{r.boundary_dtype:>6}{r.steps:>6}"
            f"{'yes' if r.bitwise_equal else 'no':>9}{r.max_abs_diff:>11.3g}{r.nmse:>11.3g}"
            f"{r.top1_agreement:>7.3f}{r.boundary_bytes_per_token:>9}"
        )


def metrics(results: list[ParityResult]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in results:
        key = f"{r.model}.{len(r.layout)}stage.{r.boundary_dtype}"
        out[key] = {
            "bitwise_equal": r.bitwise_equal,
            "max_abs_logit_diff": r.max_abs_diff,
            "nmse": r.nmse,
            "top1_agreement": r.top1_agreement,
            "steps": r.steps,
        }
    f32 = [r for r in results if r.boundary_dtype == "f32"]
    out["max_abs_logit_diff_f32"] = max((r.max_abs_diff for r in f32), default=None)
    out["all_f32_bitwise"] = all(r.bitwise_equal for r in f32)
    return out


def main(argv: list[str] | None = None) -> int:
    from dgr_artifacts.models import MODELS, model_names, model_path

    parser = argparse.ArgumentParser(prog="python -m dgr_native.parity")
    parser.add_argument("--model", action="append", choices=model_names())
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3, 5])
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--dtype", action="append", choices=["f32", "f16", "bf16"])
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    models = {name: model_path(name) for name in (args.model or sorted(MODELS))}
    results = run(models, args.stages, args.decode, args.dtype or ["f32", "f16"])
    print_table(results)
    report("parity", metrics(results))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    failed = [r for r in results if r.boundary_dtype == "f32" and not r.bitwise_equal]
    for r in failed:
        print(f"PARITY FAILED: {r.model} layout {r.layout}: max |dlogit| {r.max_abs_diff}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
