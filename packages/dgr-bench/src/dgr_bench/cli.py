"""`dgr bench`: how fast routes of local workers decode and prefill on this machine, against the
whole model through the same engine in this process at the same thread count (the reference a
route can at best match). Needs only the runtime (the engine wheel or a checkout's build): the
gate benches that also compare with llama.cpp's own binaries and RPC backend are
`nox -s bench` in a checkout.

dgr bench [--model M] [--stages 1 3] [--threads 1 2] [--mode forward] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser(
        "bench", help="route speed on this machine against the engine in one process"
    )
    from dgr_cli.commands import integer

    p.add_argument("--model", default="smollm2-135m-q4_1", help="GGUF path or registered name")
    p.add_argument(
        "--stages", type=integer(1, 256), nargs="+", default=[1, 3], help="route lengths to time"
    )
    p.add_argument("--threads", type=integer(1, 512), nargs="+", default=[1, 2], help="per process")
    p.add_argument("--mode", choices=["forward", "relay"], default="forward")
    p.add_argument("--prompt-tokens", type=integer(1, MAX_PROMPT), default=128)
    # decode is the generation less its prefill: of a token or two it is the clock's noise
    # (a 1-token decode came out as 10**9 tok/s)
    p.add_argument(
        "--decode-tokens", type=integer(4, 4096), default=64, help="timed after the first (>= 4)"
    )
    p.add_argument(
        "--rounds", type=integer(1, 100), default=3, help="generations per setup (median)"
    )
    p.add_argument("--json", type=Path, help="write the rows and ratios here, with the host")
    p.set_defaults(func=cmd_bench)


MAX_PROMPT = 16384  # prompt tokens: the engine takes them in chunks of its batch


def prompt_ids(n: int, n_vocab: int) -> list[int]:
    """A fixed prompt of `n` ids spread over the vocabulary (no tokenizer needed)."""
    return [1 + (1000 + 7 * i) % (n_vocab - 1) for i in range(n)]


def time_engine(engine: Any, prompt: list[int], decode: int, rounds: int) -> dict[str, float]:
    from dgr_bench.bench import engine_round

    engine_round(engine, prompt, 2)  # a warm-up, as the route's first prefill warms its stages
    runs = [engine_round(engine, prompt, decode) for _ in range(rounds)]
    return {k: statistics.median(r[k] for r in runs) for k in ("prefill", "decode")}


def time_stages(
    model: Path,
    n_layer: int,
    stages: int,
    threads: int,
    args: argparse.Namespace,
    prompt: list[int],
) -> dict[str, float]:
    from dgr_cli.workers import descriptor_args, start_worker
    from dgr_route.local import even_layout

    from dgr_bench.bench import time_route

    n_ctx = max(1024, 2 * (len(prompt) + args.decode_tokens + 2))
    descriptor = descriptor_args(model)
    workers = []
    try:
        for a, b in even_layout(n_layer, stages):
            workers.append(
                start_worker(
                    model, a, b, descriptor=descriptor, threads=threads, n_ctx=n_ctx, n_batch=512
                )
            )
        addresses = [w.address for w in workers]
        return time_route(addresses, prompt, args.decode_tokens, args.rounds, args.mode)
    finally:
        for w in workers:
            w.stop()


def cmd_bench(args: argparse.Namespace) -> int:
    from dgr_cli.commands import model_arg
    from dgr_route.engine import EngineNotFound, locate

    cores = len(os.sched_getaffinity(0))
    if max(args.threads) > cores:
        # one process's threads meet at a barrier after every op: past the cores, each op waits
        # for threads that have none (64 on 2 cores took minutes for an 8-token prompt)
        print(
            f"dgr bench: --threads {max(args.threads)} is more than the {cores} cores this "
            "process may use: it would time threads waiting for cores",
            file=sys.stderr,
        )
        return 2
    model = model_arg(args.model)
    if not model.is_file():
        print(f"dgr bench: no model at {model}", file=sys.stderr)
        return 2
    try:
        module = locate().module()
    except EngineNotFound as exc:
        print(f"dgr bench: {exc}", file=sys.stderr)
        return 2
    by_threads: dict[str, Any] = {}
    for threads in args.threads:
        n_ctx = max(1024, 2 * (args.prompt_tokens + args.decode_tokens + 2))
        engine = module.Engine(str(model), 0, -1, n_threads=threads, n_ctx=n_ctx, max_sessions=1)
        info = engine.describe()
        n_layer, n_vocab = int(info["n_layer"]), int(info["n_vocab"])
        if max(args.stages) > n_layer:
            print(
                f"dgr bench: --stages {max(args.stages)} is more than the model's {n_layer} layers",
                file=sys.stderr,
            )
            return 2
        prompt = prompt_ids(args.prompt_tokens, n_vocab)
        rows = {
            "engine in one process": time_engine(engine, prompt, args.decode_tokens, args.rounds)
        }
        del engine
        for stages in args.stages:
            name = f"DGR {args.mode} {stages} stage{'s' if stages > 1 else ''}"
            rows[name] = time_stages(model, n_layer, stages, threads, args, prompt)
        by_threads[str(threads)] = summarize(rows)
        print_rows(by_threads[str(threads)], threads)
    result = {
        "model": str(args.model),
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "rounds": args.rounds,
        "mode": args.mode,
        "engine": locate().source,
        "by_threads": by_threads,
        "measured_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if args.json is not None:
        from dgr_records import write_bench

        print(f"wrote {write_bench('dgr-bench', result, out=args.json)}")
    return 0


def summarize(rows: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Each row's ratios to the engine in one process (decode and prefill) and the decode time a
    token spends beyond the engine's (what the route's hops cost)."""
    ref = rows["engine in one process"]
    out: dict[str, Any] = {"rows": rows, "decode_over_engine": {}, "ms_per_token_over_engine": {}}
    out["prefill_over_engine"] = {}
    for name, row in rows.items():
        out["decode_over_engine"][name] = row["decode"] / ref["decode"]
        out["prefill_over_engine"][name] = row["prefill"] / ref["prefill"]
        out["ms_per_token_over_engine"][name] = 1000 / row["decode"] - 1000 / ref["decode"]
    return out


def print_rows(summary: dict[str, Any], threads: int) -> None:
    print(f"\n{threads} thread(s) per process")
    head = f"{'setup':<26}{'prefill tok/s':>14}{'decode tok/s':>14}{'decode/engine':>15}"
    print(head + f"{'ms/token over engine':>22}")
    for name, row in summary["rows"].items():
        print(
            f"{name:<26}{row['prefill']:>14.1f}{row['decode']:>14.1f}"
            f"{summary['decode_over_engine'][name]:>15.2f}"
            f"{summary['ms_per_token_over_engine'][name]:>22.2f}"
        )
