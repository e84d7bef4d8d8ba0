"""`nox -s bench`: decode and prefill speed of a DGR route against references measured in the
same run, on loopback: single-process llama.cpp (llama-bench), DGR with 1-4 worker stages, and
llama.cpp's own RPC backend (two ggml-rpc-server processes, -ts 1/1). Prints ratios, writes
evidence/bench/bench-route.json and reports the alpha-gate metrics (thresholds in prd.json).

Every setup runs at each thread count in THREAD_COUNTS (the reference always at the same count
as what it is compared with). On one small machine all stages share its cores: with as many
threads per process as cores, a stage's barrier threads get preempted by the other processes, a
cost a real one-stage-per-host route does not pay; the 1-thread rows show the route without it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dgr_prd.metrics import report
from dgr_prd.paths import find_root

from dgr_route.route import Route
from dgr_route.workers import descriptor_args, start_worker

PROMPT_TOKENS = 128
DECODE_TOKENS = 64
THREAD_COUNTS = (1, 2)


def llama_bench(binary: Path, model: Path, extra: list[str], threads: int) -> dict[str, float]:
    out = subprocess.run(
        [
            str(binary),
            "-m",
            str(model),
            "-p",
            str(PROMPT_TOKENS),
            "-n",
            str(DECODE_TOKENS),
            "-t",
            str(threads),
            "-r",
            "3",
            "-o",
            "json",
            *extra,
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    rows = json.loads(out.stdout)
    result = {}
    for row in rows:
        key = "prefill" if row["n_prompt"] > 0 else "decode"
        result[key] = float(row["avg_ts"])
    return result


def rpc_servers(
    binary: Path, count: int, threads: int
) -> tuple[list[subprocess.Popen[str]], list[str]]:
    import socket

    procs, addresses = [], []
    for _ in range(count):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs.append(
            subprocess.Popen(
                [str(binary), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        )
        addresses.append(f"127.0.0.1:{port}")
    for proc, address in zip(procs, addresses, strict=True):
        wait_listening(proc, address)
    return procs, addresses


def wait_listening(proc: subprocess.Popen[str], address: str, timeout: float = 60.0) -> None:
    """Until the server accepts connections (it exiting first is an error)."""
    import socket

    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server for {address} exited with {proc.returncode}")
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"server for {address} is not listening after {timeout:.0f} s")


def dgr_route(
    model: Path, n_stages: int, n_layer: int, descriptor: list[str], rounds: int, threads: int
) -> dict[str, float]:
    from dgr_native.parity import even_layout

    workers = [
        start_worker(model, a, b, descriptor=descriptor, threads=threads, n_ctx=1024, n_batch=512)
        for a, b in even_layout(n_layer, n_stages)
    ]
    try:
        prompt = [1000 + (i * 7) % 5000 for i in range(PROMPT_TOKENS)]
        return time_route([w.address for w in workers], prompt, DECODE_TOKENS, rounds)
    finally:
        for w in workers:
            w.stop()


def time_route(
    addresses: list[str], prompt: list[int], decode_tokens: int, rounds: int
) -> dict[str, float]:
    """Median prefill and decode tokens/s of greedy generation over the route at `addresses`."""
    route = Route.open(addresses, timeout=120)
    prefill, decode = [], []
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            stream = route.generate(prompt, decode_tokens + 1)
            next(stream)
            t1 = time.perf_counter()
            for _ in stream:
                pass
            t2 = time.perf_counter()
            prefill.append(len(prompt) / (t1 - t0))
            decode.append(decode_tokens / (t2 - t1))
    finally:
        route.close()
    return {"prefill": statistics.median(prefill), "decode": statistics.median(decode)}


def main(argv: list[str] | None = None) -> int:
    from dgr_artifacts.models import model_path
    from dgr_llamacpp.build import build
    from dgr_llamacpp.workspace import open_workspace

    parser = argparse.ArgumentParser(prog="python -m dgr_route.bench")
    parser.add_argument("--model", default="smollm2-135m-q4_1")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    model = model_path(args.model)
    ws = open_workspace()
    plain = build(ws, "cpu", ["llama-bench"], log=sys.stderr)
    with_rpc = build(ws, "cpu-rpc", ["llama-bench", "ggml-rpc-server"], log=sys.stderr)
    descriptor = descriptor_args(model)
    from dgr_artifacts.identity import open_model

    meta = open_model(model)
    n_layer, n_embd = meta.n_layer, int(meta.hparams()[f"{meta.arch}.embedding_length"])

    results: dict[str, Any] = {
        "model": args.model,
        "prompt_tokens": PROMPT_TOKENS,
        "decode_tokens": DECODE_TOKENS,
        "boundary_bytes_per_token_f32": n_embd * 4,
        "by_threads": {},
    }
    targets = {
        "decode_ratio_3stage_vs_single": 0.95,
        "decode_ratio_3stage_vs_rpc": 1.6,
        "prefill_ratio_3stage_vs_single": 0.95,
    }
    for threads in THREAD_COUNTS:
        rows = measure(model, n_layer, descriptor, args.rounds, threads, plain, with_rpc)
        results["by_threads"][str(threads)] = summarize(rows, threads, n_embd, targets)
    gate = results["by_threads"][str(min(THREAD_COUNTS))]["ratios"]
    results["gate_threads"] = min(THREAD_COUNTS)
    out_dir = find_root().evidence / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench-route.json").write_text(json.dumps(results, indent=2) + "\n")
    report(
        "bench",
        {
            **{k: round(v, 4) for k, v in gate.items()},
            **{
                f"{k}_{t}threads": round(v, 4)
                for t, r in results["by_threads"].items()
                for k, v in r["ratios"].items()
            },
        },
    )
    return 0


def measure(
    model: Path,
    n_layer: int,
    descriptor: list[str],
    rounds: int,
    threads: int,
    plain: Path,
    with_rpc: Path,
) -> dict[str, dict[str, float]]:
    rows: dict[str, dict[str, float]] = {}
    rows["single process (llama-bench)"] = llama_bench(plain / "llama-bench", model, [], threads)
    for n in (1, 2, 3, 4):
        rows[f"DGR {n} stage{'s' if n > 1 else ''}"] = dgr_route(
            model, n, n_layer, descriptor, rounds, threads
        )
    procs, addresses = rpc_servers(with_rpc / "ggml-rpc-server", 2, threads)
    try:
        rows["llama.cpp RPC (2 servers)"] = llama_bench(
            with_rpc / "llama-bench",
            model,
            ["--rpc", ",".join(addresses), "-ngl", "99", "-ts", "1/1"],
            threads,
        )
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    return rows


def summarize(
    rows: dict[str, dict[str, float]], threads: int, n_embd: int, targets: dict[str, float]
) -> dict[str, Any]:
    single, three, rpc = (
        rows["single process (llama-bench)"],
        rows["DGR 3 stages"],
        rows["llama.cpp RPC (2 servers)"],
    )
    one = rows["DGR 1 stage"]
    per_seam_ms = {
        f"{n} stages": (1000 / rows[f"DGR {n} stages"]["decode"] - 1000 / one["decode"]) / (n - 1)
        for n in (2, 3, 4)
    }
    ratios = {
        "decode_ratio_3stage_vs_single": three["decode"] / single["decode"],
        "decode_ratio_3stage_vs_rpc": three["decode"] / rpc["decode"],
        "prefill_ratio_3stage_vs_single": three["prefill"] / single["prefill"],
        "decode_ratio_3stage_vs_1stage": three["decode"] / one["decode"],
    }
    print(f"\n{threads} thread(s) per process")
    print(f"{'setup':<30}{'prefill tok/s':>14}{'decode tok/s':>14}{'decode / single':>17}")
    for name, r in rows.items():
        print(
            f"{name:<30}{r['prefill']:>14.1f}{r['decode']:>14.1f}"
            f"{r['decode'] / single['decode']:>17.2f}"
        )
    print(f"boundary bytes per token per seam: {n_embd * 4} (f32), {n_embd * 2} (f16/bf16)")
    for name, ms in per_seam_ms.items():
        print(f"per-seam decode overhead per token ({name}): {ms:.2f} ms")
    for key, target in targets.items():
        verdict = "meets" if ratios[key] >= target else f"MISSES by {target - ratios[key]:.2f}"
        print(f"{key}: {ratios[key]:.3f} (target >= {target}) {verdict}")
    return {"rows": rows, "ratios": ratios, "per_seam_decode_ms": per_seam_ms}


if __name__ == "__main__":
    sys.exit(main())
