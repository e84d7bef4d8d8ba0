"""`dgr demo`: three local shard workers on the default model, a route through them, streamed
greedy generation with tokens/s, and a parity check against the whole model in one process."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np
from dgr_route.route import Route
from dgr_route.text import Detokenizer
from dgr_route.tokenizer import Tokenizer

from dgr_cli.commands import MAX_TOKENS, counted, integer
from dgr_cli.workers import descriptor_args, start_worker

N_CTX = 1024  # each demo worker's context


def run_demo(args: argparse.Namespace) -> int:
    from dgr_artifacts.models import MODELS, model_path
    from dgr_route.local import Chain, even_layout

    try:
        model = model_path(args.model)
    except KeyError as exc:  # its message names the models there are
        print(f"dgr demo: {exc.args[0]}", file=sys.stderr)
        return 2
    if args.model not in MODELS:
        print(
            f"{args.model} is a generated twin with random weights: its text means nothing, the "
            "parity with the single-process run is the point"
        )
    tokenizer = Tokenizer(model)
    whole = Chain(model, [(0, -1)])
    n_layer = int(whole.engines[0].describe()["n_layer"])
    if args.stages > n_layer:
        print(
            f"dgr demo: --stages {args.stages} is more than the model's {n_layer} layers",
            file=sys.stderr,
        )
        return 2
    prompt = tokenizer.encode(args.prompt)
    if not prompt or len(prompt) >= N_CTX:
        what = "encodes to no tokens" if not prompt else f"is {len(prompt)} tokens"
        print(
            f"dgr demo: --prompt {what}: the demo takes 1 to {N_CTX - 1} (its context is {N_CTX})",
            file=sys.stderr,
        )
        return 2
    layout = even_layout(n_layer, args.stages)
    descriptor = descriptor_args(model)
    t0 = time.perf_counter()
    workers = [
        start_worker(model, a, b, descriptor=descriptor, n_ctx=N_CTX, n_batch=512)
        for a, b in layout
    ]
    print(
        f"{len(workers)} workers up in {time.perf_counter() - t0:.1f} s: "
        + ", ".join(f"layers [{w.layers.first}, {w.layers.last}) at {w.address}" for w in workers)
    )
    try:
        route = Route.open([w.address for w in workers], wire_dtype=args.wire_dtype, mode=args.mode)
        print(f"prompt ({len(prompt)} tokens): {args.prompt}\n---", flush=True)
        tokens: list[int] = []
        detok = Detokenizer(tokenizer.detokenize)
        t1 = time.perf_counter()
        first_at = t1
        for token in route.generate(prompt, args.max_tokens):
            if not tokens:
                first_at = time.perf_counter()
            tokens.append(token)
            if tokenizer.is_eog(token):
                break
            sys.stdout.write(detok.feed(token))
            sys.stdout.flush()
        t2 = time.perf_counter()
        sys.stdout.write(detok.flush())
        route.close()
    finally:
        for w in workers:
            w.stop()
    decode_rate = (len(tokens) - 1) / max(t2 - first_at, 1e-9)
    # decode is timed from the first token on: one token (--max-tokens 1, or an end of
    # generation first) times none, and the ratio is left out rather than divided by zero
    timed = len(tokens) > 1
    decode = f"decode {decode_rate:.1f} tok/s" if timed else "decode not timed (one token)"
    print(
        f"\n---\nroute: first token after {first_at - t1:.2f} s ({len(prompt)}-token prefill), "
        f"{decode} over {counted(len(workers), 'worker process', 'worker processes')} "
        f"({args.mode} mode)"
    )
    # the same greedy generation in one process, over the whole model
    ref: list[int] = [int(np.argmax(whole.step(np.asarray(prompt, dtype=np.int32))))]
    t3 = time.perf_counter()
    while len(ref) < len(tokens):
        ref.append(int(np.argmax(whole.step(np.array([ref[-1]], dtype=np.int32)))))
    t4 = time.perf_counter()
    single = (len(ref) - 1) / max(t4 - t3, 1e-9)
    if timed:
        print(
            f"single process (whole model, same build): decode {single:.1f} tok/s; route/single "
            f"{decode_rate / single:.2f}"
        )
    against = "the single-process run"
    if args.wire_dtype != "f32":
        # a rounded wire is compared with the same rounding in one process
        chain = Chain(model, layout, args.wire_dtype)
        _, ref = chain.greedy(np.asarray(prompt, dtype=np.int32), len(tokens))
        against = f"the same layout in one process with a {args.wire_dtype} boundary"
    same = ref == tokens
    print(
        f"parity: {len(tokens)} greedy tokens {'identical' if same else 'DIFFERENT'} to {against}"
    )
    return 0 if same else 1


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="3 local workers on the default model, generate, check")
    p.add_argument("--model", default="smollm2-135m-q4_1")
    p.add_argument("--stages", type=integer(1, 256), default=3)
    p.add_argument("--wire-dtype", choices=["f32", "f16", "bf16"], default="f32")
    p.add_argument("--mode", choices=["forward", "relay"], default="forward")
    p.add_argument("--max-tokens", type=MAX_TOKENS, default=48)
    p.add_argument(
        "--prompt", default="Three reasons to split a language model across several machines are"
    )
    p.set_defaults(func=run_demo)
