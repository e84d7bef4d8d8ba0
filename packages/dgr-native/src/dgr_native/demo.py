"""`dgr demo`: the default model split into in-process shards, streaming generation, speed and a
parity check against the whole model. (The workers-over-gRPC route replaces the in-process
chain once the worker lands; the split, the boundary and the check stay the same.)"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from dgr_native.parity import Chain, even_layout


def run_demo(args: argparse.Namespace) -> int:
    from dgr_artifacts.models import model_path

    model = model_path(args.model)
    whole = Chain(model, [(0, -1)])
    n_layer = int(whole.engines[0].describe()["n_layer"])
    layout = even_layout(n_layer, args.stages)
    chain = Chain(model, layout)
    print(
        f"model {model.name}: {n_layer} layers split into {layout} "
        f"({chain.boundary_bytes_per_token()} boundary bytes per token per seam)"
    )
    prompt = chain.tokenize(args.prompt)
    print(f"prompt ({len(prompt)} tokens): {args.prompt}\n---", flush=True)
    t0 = time.perf_counter()
    logits = [chain.step(prompt)]
    t_prefill = time.perf_counter() - t0
    tokens: list[int] = [int(np.argmax(logits[-1]))]
    t1 = time.perf_counter()
    head = chain.engines[0]
    while len(tokens) < args.max_tokens and not head.is_eog(tokens[-1]):
        sys.stdout.write(head.detokenize([tokens[-1]]).decode("utf-8", errors="replace"))
        sys.stdout.flush()
        logits.append(chain.step(np.array([tokens[-1]], dtype=np.int32)))
        tokens.append(int(np.argmax(logits[-1])))
    t_decode = time.perf_counter() - t1
    print("\n---")
    decoded = len(tokens) - 1
    print(
        f"prefill {len(prompt) / t_prefill:.1f} tok/s, decode {decoded / t_decode:.1f} tok/s "
        f"({args.stages} shards, greedy)"
    )
    t2 = time.perf_counter()
    ref = [whole.step(prompt)]
    t3 = time.perf_counter()
    ref += [whole.step(np.array([t], dtype=np.int32)) for t in tokens[:-1]]
    t4 = time.perf_counter()
    print(
        f"whole model in one engine: prefill {len(prompt) / (t3 - t2):.1f} tok/s, decode "
        f"{decoded / (t4 - t3):.1f} tok/s; shards/whole decode ratio "
        f"{(decoded / t_decode) / (decoded / (t4 - t3)):.2f}"
    )
    same = all(
        np.array_equal(a.view(np.uint32), b.view(np.uint32))
        for a, b in zip(logits, ref, strict=True)
    )
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(logits, ref, strict=True))
    print(
        f"parity with the whole model over {len(ref)} steps: "
        f"{'bitwise equal' if same else 'DIFFERENT'} (max |dlogit| = {diff:g})"
    )
    return 0 if same else 1


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="split the default model into shards and generate")
    p.add_argument("--model", default="smollm2-135m-q4_1")
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument(
        "--prompt", default="Three reasons to split a language model across several machines are"
    )
    p.set_defaults(func=run_demo)
