"""`nox -s bench`: decode and prefill speed of DGR routes against references measured in the same
run, on loopback: single-process llama.cpp (llama-bench), the whole model through the ShardEngine
in one process, DGR in forward and relay mode with 1-4 worker stages, and llama.cpp's own RPC
backend with 2 and 3 ggml-rpc-server processes. Every setup runs at 1 and 2 threads per process
(the reference always at the same count). Prints ratios, writes evidence/bench/bench-route.json
and reports the alpha-gate metrics (thresholds in prd.json's alpha gate; `dgr-prd gate alpha`
checks them).

On a shared VM whose speed drifts by 10% and more over minutes, ratios of setups timed minutes
apart move with the drift (one run put llama-bench's two builds of the same code 13% apart). The
gate's ratios therefore come from interleaved rounds (`paired`): llama-bench (both builds), the
engine in process, 1- and 3-stage forward routes and RPC with 2 servers, each once per round, back
to back, every process up throughout; a round's ratio compares setups that saw the same machine,
and the gate reads the median over rounds. The table's other rows are timed each in its own
block; its reference rows are the rounds' medians.

On one small machine all stages share its cores: with as many threads per process as cores, a
stage's barrier threads get preempted by anything else that runs, a cost a real one-stage-per-host
route does not pay; the 1-thread rows show the route without it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from dgr_cli.workers import descriptor_args, start_worker
from dgr_records import report, write_bench
from dgr_route.route import MODES, Route

from dgr_bench import pinning

PROMPT_TOKENS = 128
DECODE_TOKENS = 64
THREAD_COUNTS = (1, 2)
GATE_THREADS = 2  # the protocol the alpha thresholds were locked with
STAGES = (1, 2, 3, 4)
RPC_SERVERS = (2, 3)
# the single-process reference is the fastest of llama-bench as upstream builds it (OpenMP), as
# DGR's lane builds it (ggml's threadpool), and that build with the compute threads' priority DGR's
# workers take with `--prio auto` (`--prio 1`, SCHED_FIFO): DGR is held to the best of the three
SINGLE_STOCK = "llama-bench, upstream build"
SINGLE_LANE = "llama-bench, DGR lane build"
SINGLE_PRIO = "llama-bench, DGR lane build, --prio 1"
SINGLES = (SINGLE_STOCK, SINGLE_LANE, SINGLE_PRIO)
ENGINE = "engine in one process"
ONE, THREE = "DGR forward 1 stage", "DGR forward 3 stages"
# the same 3-stage route with its workers' compute threads at a realtime priority (`--prio auto`,
# opt-in): reported beside the default, not gated
THREE_RT = "DGR forward 3 stages, --prio auto"
# and over gRPC calls between the stages instead of data streams (`--links grpc`, what TLS
# routes use): the data plane's gain, measured beside it
THREE_GRPC = "DGR forward 3 stages, --links grpc"
RPC2 = "llama.cpp RPC (2 servers)"
BATCHED_BENCH = "llama-batched-bench"
PAIRED_ROUNDS = 7
# concurrent sessions: FIFO turns, batched, and llama.cpp's own batched decode, interleaved
BATCH_ROUNDS = 3


def llama_bench(
    binary: Path, model: Path, extra: list[str], threads: int, reps: int = 3
) -> dict[str, float]:
    """llama-bench's prefill of the prompt (from an empty context) and its decode after the
    prompt (`-d`: at a context depth of PROMPT_TOKENS), which is what a route does; plain tg
    would decode from an empty context, with cheaper attention than the route pays."""
    out = subprocess.run(
        [
            str(binary),
            "-m",
            str(model),
            "-p",
            str(PROMPT_TOKENS),
            "-n",
            str(DECODE_TOKENS),
            "-d",
            f"0,{PROMPT_TOKENS}",
            "-t",
            str(threads),
            "-r",
            str(reps),
            "-o",
            "json",
            *extra,
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    result = {}
    for row in json.loads(out.stdout):
        depth = int(row.get("n_depth", 0))
        if row["n_prompt"] > 0 and depth == 0:
            result["prefill"] = float(row["avg_ts"])
        elif row["n_gen"] > 0 and depth == PROMPT_TOKENS:
            result["decode"] = float(row["avg_ts"])
    return result


def batched_bench(binary: Path, model: Path, threads: int) -> dict[int, float]:
    """llama.cpp's own batched decode in one process (llama-batched-bench): decode tok/s of 1 and
    4 sequences together, each after a 32-token prompt, as concurrent_decode runs them. Its
    4-over-1 ratio is what batching can gain on this machine at all."""
    out = subprocess.run(
        [
            str(binary),
            "-m",
            str(model),
            "-t",
            str(threads),
            "-c",
            str(4 * 1024),
            "-b",
            "512",
            "-ub",
            "512",
            "-npp",
            "32",
            "-ntg",
            str(DECODE_TOKENS),
            "-npl",
            "1,4",
            "--output-format",
            "jsonl",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {int(r["pl"]): float(r["speed_tg"]) for r in rows}


def rpc_servers(
    binary: Path, count: int, threads: int
) -> tuple[list[subprocess.Popen[str]], list[str]]:
    import socket

    procs, addresses = [], []
    for i in range(count):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs.append(
            subprocess.Popen(
                [
                    *pinning.taskset(i, threads),
                    str(binary),
                    *("-H", "127.0.0.1", "-p", str(port), "-t", str(threads)),
                ],
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


def prompt_tokens() -> list[int]:
    return [1000 + (i * 7) % 5000 for i in range(PROMPT_TOKENS)]


def dgr_route(
    model: Path,
    n_stages: int,
    n_layer: int,
    descriptor: list[str],
    rounds: int,
    threads: int,
) -> dict[str, dict[str, float]]:
    """Both modes over the same workers: {mode: {prefill, decode}}."""
    from dgr_route.local import even_layout

    workers = [
        start_worker(
            model,
            a,
            b,
            descriptor=descriptor,
            threads=threads,
            n_ctx=1024,
            n_batch=512,
            extra=pinning.worker_args(i, threads),
        )
        for i, (a, b) in enumerate(even_layout(n_layer, n_stages))
    ]
    try:
        return {
            mode: time_route(
                [w.address for w in workers], prompt_tokens(), DECODE_TOKENS, rounds, mode
            )
            for mode in MODES
        }
    finally:
        for w in workers:
            w.stop()


def time_route(
    addresses: list[str],
    prompt: list[int],
    decode_tokens: int,
    rounds: int,
    mode: str = "forward",
    peers: list[str] | None = None,
) -> dict[str, float]:
    """Median prefill and decode tokens/s of greedy generation over the route at `addresses`."""
    route = Route.open(addresses, timeout=120, mode=mode, peers=peers, prefix_reuse=False)
    try:
        runs = [route_round(route, prompt, decode_tokens) for _ in range(rounds)]
    finally:
        route.close()
    return {key: statistics.median(r[key] for r in runs) for key in ("prefill", "decode")}


def route_round(route: Route, prompt: list[int], decode_tokens: int) -> dict[str, float]:
    """One greedy generation over `route`: prefill and decode tokens/s.

    Both are timed from generations that end with the route idle: the prompt with
    `decode_tokens` more, between two prefills alone (the prompt and its first token); decode is
    the generation less the mean of the two prefills. The arrival of the first token of a longer
    generation is no clock: in forward mode the stages go on decoding at once, and on a host they
    share with the coordinator (their compute threads at a realtime priority) the coordinator may
    see that token only some tokens later, which would shorten the decode it times. (The faster
    of the two prefills would make decode err slow by the prefill's spread: 5-10% here.)"""

    def timed(max_tokens: int) -> float:
        t0 = time.perf_counter()
        for _ in route.generate(prompt, max_tokens):
            pass
        return time.perf_counter() - t0

    before = timed(1)
    whole = timed(decode_tokens + 1)
    first = (before + timed(1)) / 2
    return {"prefill": len(prompt) / first, "decode": decode_tokens / max(whole - first, 1e-9)}


def concurrent_decode(
    model: Path, n_layer: int, descriptor: list[str], threads: int, max_batch: int
) -> dict[str, float]:
    """Aggregate decode tokens/s of 1, 2 and 4 sessions generating at once on a 3-stage forward
    route whose workers batch up to `max_batch` sessions' decode steps (1: FIFO turns)."""
    from dgr_route.local import even_layout

    workers = [
        start_worker(
            model,
            a,
            b,
            descriptor=descriptor,
            threads=threads,
            n_ctx=1024,
            max_sessions=4,
            extra=["--max-batch", str(max_batch), *pinning.worker_args(i, threads)],
        )
        for i, (a, b) in enumerate(even_layout(n_layer, 3))
    ]
    rates: dict[str, float] = {}
    try:
        route = Route.open([w.address for w in workers], timeout=120, prefix_reuse=False)
        for n in (1, 2, 4):
            rates[f"{n} sessions"] = sessions_at_once(route, n, DECODE_TOKENS)
        route.close()
    finally:
        for w in workers:
            w.stop()
    return rates


def sessions_at_once(route: Route, n: int, tokens: int) -> float:
    """Aggregate decode tok/s of n sessions generating `tokens` each at once over `route`, from
    distinct 32-token prompts. Forward mode decodes on while its client reads: whole generations
    (their prefills included) are timed from a common start to the last one's end."""
    prompts = [[1000 + (i * 7 + 13 * k) % 5000 for i in range(32)] for k in range(n)]
    start = threading.Barrier(n + 1)
    done: list[float] = []

    def run(prompt: list[int]) -> None:
        start.wait()
        for _ in route.generate(prompt, tokens):
            pass
        done.append(time.perf_counter())

    pool = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in pool:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in pool:
        t.join(600)
    return n * tokens / (max(done) - t0)


def engine_round(
    engine: Any, prompt_ids: list[int], decode_tokens: int = DECODE_TOKENS
) -> dict[str, float]:
    """One greedy generation through `engine` (a whole-model ShardEngine) in this process; the
    prompt in forwards of at most the engine's batch, as a route's stages take it."""
    import numpy as np

    prompt = np.asarray(prompt_ids, dtype=np.int32)
    n_batch = int(engine.describe()["n_batch"])
    t0 = time.perf_counter()
    for start in range(0, len(prompt), n_batch):
        logits = engine.forward(1, 1, start, tokens=prompt[start : start + n_batch])
    token = int(np.argmax(logits[-1]))
    t1 = time.perf_counter()
    for i in range(decode_tokens):
        row = engine.forward(1, 1, len(prompt) + i, tokens=np.array([token], np.int32))
        token = int(np.argmax(row[-1]))
    t2 = time.perf_counter()
    engine.release(1)
    return {"prefill": len(prompt) / (t1 - t0), "decode": decode_tokens / (t2 - t1)}


def paired(
    model: Path,
    n_layer: int,
    descriptor: list[str],
    rounds: int,
    threads: int,
    plain: Path,
    with_rpc: Path,
) -> list[dict[str, dict[str, float]]]:
    """The setups the gate compares, timed in interleaved rounds: each round runs every one of
    them once, back to back, in an order rotated from round to round. Every process stays up
    (idle between its turns), so the rounds time generations, not starts. A shared VM drifts by
    10% and more over minutes; a ratio taken within a round, where reference and route see the
    same machine, does not carry that drift (the table's rows, timed minutes apart, do)."""
    from dgr_route.engine import locate
    from dgr_route.local import even_layout

    prompt = prompt_tokens()
    engine = (
        locate().module().Engine(str(model), 0, -1, n_threads=threads, n_ctx=1024, max_sessions=1)
    )
    fleets: dict[str, list[Any]] = {}
    routes: dict[str, Route] = {}
    procs, servers = rpc_servers(with_rpc / "ggml-rpc-server", 2, threads)
    rpc = ["--rpc", ",".join(servers), "-ngl", "99", "-ts", "1/1"]
    try:
        fleet_setups = {
            ONE: (1, []),
            THREE: (3, []),
            THREE_RT: (3, ["--prio", "auto"]),
            THREE_GRPC: (3, ["--links", "grpc"]),
        }
        for name, (n, extra) in fleet_setups.items():
            fleets[name] = [
                start_worker(
                    model,
                    a,
                    b,
                    descriptor=descriptor,
                    threads=threads,
                    n_ctx=1024,
                    extra=[*extra, *pinning.worker_args(i, threads)],
                )
                for i, (a, b) in enumerate(even_layout(n_layer, n))
            ]
            routes[name] = Route.open(
                [w.address for w in fleets[name]], timeout=120, prefix_reuse=False
            )
        setups = {
            SINGLE_STOCK: lambda: llama_bench(with_rpc / "llama-bench", model, [], threads, 1),
            SINGLE_LANE: lambda: llama_bench(plain / "llama-bench", model, [], threads, 1),
            SINGLE_PRIO: lambda: llama_bench(
                plain / "llama-bench", model, ["--prio", "1"], threads, 1
            ),
            ENGINE: lambda: engine_round(engine, prompt),
            ONE: lambda: route_round(routes[ONE], prompt, DECODE_TOKENS),
            THREE: lambda: route_round(routes[THREE], prompt, DECODE_TOKENS),
            THREE_RT: lambda: route_round(routes[THREE_RT], prompt, DECODE_TOKENS),
            THREE_GRPC: lambda: route_round(routes[THREE_GRPC], prompt, DECODE_TOKENS),
            RPC2: lambda: llama_bench(with_rpc / "llama-bench", model, rpc, threads, 1),
        }
        engine_round(engine, prompt)  # untimed: the engine's first graphs (workers warm up alone)
        names = list(setups)
        out = []
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            out.append({name: setups[name]() for name in order})
        return out
    finally:
        for route in routes.values():
            route.close()
        for fleet in fleets.values():
            for w in fleet:
                w.stop()
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def paired_ratios(rounds: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Per-round ratios (the single-process reference is that round's fastest llama-bench setup)
    and their medians; the medians are the gate's values."""

    def single(r: dict[str, dict[str, float]], key: str) -> float:
        return max(r[name][key] for name in SINGLES)

    per_round: dict[str, list[float]] = {
        "decode_ratio_3stage_vs_single": [r[THREE]["decode"] / single(r, "decode") for r in rounds],
        "decode_ratio_3stage_vs_rpc": [r[THREE]["decode"] / r[RPC2]["decode"] for r in rounds],
        "prefill_ratio_3stage_vs_single": [
            r[THREE]["prefill"] / single(r, "prefill") for r in rounds
        ],
        "decode_ratio_3stage_vs_engine": [r[THREE]["decode"] / r[ENGINE]["decode"] for r in rounds],
        "decode_ratio_3stage_realtime_vs_single": [
            r[THREE_RT]["decode"] / single(r, "decode") for r in rounds
        ],
        "decode_ratio_3stage_data_vs_grpc_links": [
            r[THREE]["decode"] / r[THREE_GRPC]["decode"] for r in rounds
        ],
        "decode_ratio_1stage_vs_engine": [r[ONE]["decode"] / r[ENGINE]["decode"] for r in rounds],
        "ms_per_token_1stage_over_engine": [
            1000 / r[ONE]["decode"] - 1000 / r[ENGINE]["decode"] for r in rounds
        ],
    }
    return {
        "ratios": {k: statistics.median(v) for k, v in per_round.items()},
        "per_round": per_round,
        "rows": {
            name: {k: statistics.median(r[name][k] for r in rounds) for k in ("prefill", "decode")}
            for name in rounds[0]
        },
    }


def main(argv: list[str] | None = None) -> int:
    from dgr_artifacts.identity import open_model
    from dgr_artifacts.models import model_path
    from dgr_llamacpp.build import build
    from dgr_llamacpp.workspace import open_workspace

    parser = argparse.ArgumentParser(prog="python -m dgr_bench.bench")
    parser.add_argument("--model", default="smollm2-135m-q4_1")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--paired-rounds", type=int, default=PAIRED_ROUNDS)
    parser.add_argument("--threads", type=int, nargs="+", default=list(THREAD_COUNTS))
    parser.add_argument(
        "--pin-stages",
        action="store_true",
        help="each stage (and RPC server) on cores of its own, where the host has enough "
        "(the gate's host condition; recorded in the JSON)",
    )
    args = parser.parse_args(argv)
    pinning.enable(args.pin_stages)
    model = model_path(args.model)
    ws = open_workspace()
    plain = build(ws, "cpu", ["llama-bench", "llama-batched-bench"], log=sys.stderr)
    with_rpc = build(ws, "cpu-rpc", ["llama-bench", "ggml-rpc-server"], log=sys.stderr)
    descriptor = descriptor_args(model)
    meta = open_model(model)
    n_layer, n_embd = meta.n_layer, int(meta.hparams()[f"{meta.arch}.embedding_length"])

    results: dict[str, Any] = {
        "model": args.model,
        "prompt_tokens": PROMPT_TOKENS,
        "decode_tokens": DECODE_TOKENS,
        "rounds": args.rounds,
        "boundary_bytes_per_token_f32": n_embd * 4,
        "by_threads": {},
    }
    for threads in args.threads:
        rounds = paired(model, n_layer, descriptor, args.paired_rounds, threads, plain, with_rpc)
        interleaved = paired_ratios(rounds)
        rows = measure(
            model, n_layer, descriptor, args.rounds, threads, with_rpc, plain, interleaved["rows"]
        )
        summary = summarize(rows, threads, n_embd)
        summary["paired"] = interleaved
        summary["ratios"] = {**summary["table_ratios"], **interleaved["ratios"]}
        print_paired(interleaved, threads)
        results["by_threads"][str(threads)] = summary
    gate: dict[str, float] = {}
    if str(GATE_THREADS) in results["by_threads"]:
        gate.update(results["by_threads"][str(GATE_THREADS)]["ratios"])
    for t, r in results["by_threads"].items():
        gate.update({f"{k}_{t}threads": v for k, v in r["ratios"].items()})
    results["gate_threads"] = GATE_THREADS
    results["pinning"] = pinning.record(3, GATE_THREADS)
    results["gate_metrics"] = {"bench": gate}  # what `dgr-prd gate alpha` reads
    results["measured_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_bench("bench-route", results)
    report("bench", {k: round(v, 4) for k, v in gate.items()})
    return 0


def concurrent(
    model: Path, n_layer: int, descriptor: list[str], threads: int, plain: Path
) -> dict[str, dict[str, float]]:
    """Rows for 1, 2 and 4 concurrent sessions on a 3-stage forward route, FIFO turns against
    batched, and llama-batched-bench's 1 and 4 sequences in one process: BATCH_ROUNDS
    interleaved rounds (one run each swings 0.75-2.1x here), medians."""
    runs: dict[str, list[float]] = {}
    for _ in range(BATCH_ROUNDS):
        for max_batch, name in ((1, "FIFO turns"), (16, "batched")):
            rates = concurrent_decode(model, n_layer, descriptor, threads, max_batch)
            for n, rate in rates.items():
                runs.setdefault(f"DGR forward 3 stages, {n}, {name}", []).append(rate)
        for seqs, rate in batched_bench(plain / "llama-batched-bench", model, threads).items():
            name = f"{BATCHED_BENCH}, {seqs} sequence{'s' if seqs > 1 else ''}"
            runs.setdefault(name, []).append(rate)
    return {k: {"prefill": 0.0, "decode": statistics.median(v)} for k, v in runs.items()}


def measure(
    model: Path,
    n_layer: int,
    descriptor: list[str],
    rounds: int,
    threads: int,
    with_rpc: Path,
    plain: Path,
    references: dict[str, dict[str, float]],
) -> dict[str, dict[str, float]]:
    """Every setup's row. The references (llama-bench, the engine, RPC with 2 servers) are the
    interleaved rounds' medians, `references`, not timed a second time."""
    rows: dict[str, dict[str, float]] = {k: references[k] for k in (*SINGLES, ENGINE)}
    for n in STAGES:
        for mode, row in dgr_route(model, n, n_layer, descriptor, rounds, threads).items():
            rows[f"DGR {mode} {n} stage{'s' if n > 1 else ''}"] = row
    rows.update(concurrent(model, n_layer, descriptor, threads, plain))
    rows[RPC2] = references[RPC2]
    for count in RPC_SERVERS:
        if f"llama.cpp RPC ({count} servers)" in rows:
            continue
        procs, addresses = rpc_servers(with_rpc / "ggml-rpc-server", count, threads)
        try:
            rows[f"llama.cpp RPC ({count} servers)"] = llama_bench(
                with_rpc / "llama-bench",
                model,
                ["--rpc", ",".join(addresses), "-ngl", "99", "-ts", "/".join(["1"] * count)],
                threads,
            )
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)
    return rows


def summarize(rows: dict[str, dict[str, float]], threads: int, n_embd: int) -> dict[str, Any]:
    single = {key: max(rows[name][key] for name in SINGLES) for key in ("prefill", "decode")}
    engine = rows[ENGINE]
    three, rpc, one = rows[THREE], rows[RPC2], rows[ONE]
    per_token_ms = {
        name: 1000 / r["decode"] - 1000 / engine["decode"]
        for name, r in rows.items()
        if name.startswith("DGR") and "sessions" not in name
    }
    ratios = {
        "decode_ratio_3stage_vs_single": three["decode"] / single["decode"],
        "decode_ratio_3stage_vs_rpc": three["decode"] / rpc["decode"],
        "prefill_ratio_3stage_vs_single": three["prefill"] / single["prefill"],
        "decode_ratio_3stage_vs_engine": three["decode"] / engine["decode"],
        "decode_ratio_1stage_vs_engine": one["decode"] / engine["decode"],
        "decode_ratio_3stage_forward_vs_relay": three["decode"]
        / rows["DGR relay 3 stages"]["decode"],
        "batched_4sessions_over_fifo": rows["DGR forward 3 stages, 4 sessions, batched"]["decode"]
        / rows["DGR forward 3 stages, 4 sessions, FIFO turns"]["decode"],
        # what batching gains in one process with llama.cpp's own batched decode (no route, no
        # FIFO baseline): the ceiling of the DGR ratio above on this machine
        "upstream_batched_4_over_1": rows[f"{BATCHED_BENCH}, 4 sequences"]["decode"]
        / rows[f"{BATCHED_BENCH}, 1 sequence"]["decode"],
        "batched_4sessions_over_1session": rows["DGR forward 3 stages, 4 sessions, batched"][
            "decode"
        ]
        / rows["DGR forward 3 stages, 1 sessions, batched"]["decode"],
    }
    print(f"\n{threads} thread(s) per process")
    print(
        f"{'setup':<30}{'prefill tok/s':>14}{'decode tok/s':>14}{'decode / single':>17}"
        f"{'ms/token over engine':>22}"
    )
    for name, r in rows.items():
        extra = f"{per_token_ms[name]:>22.2f}" if name in per_token_ms else ""
        print(
            f"{name:<30}{r['prefill']:>14.1f}{r['decode']:>14.1f}"
            f"{r['decode'] / single['decode']:>17.2f}{extra}"
        )
    print(f"boundary bytes per token per seam: {n_embd * 4} (f32), {n_embd * 2} (f16/bf16)")
    for key, value in ratios.items():
        print(f"{key}: {value:.3f}")
    return {"rows": rows, "table_ratios": ratios, "per_token_ms_over_engine": per_token_ms}


def print_paired(p: dict[str, Any], threads: int) -> None:
    n = len(next(iter(p["per_round"].values())))
    print(f"\n{threads} thread(s) per process, {n} interleaved rounds (median, min-max)")
    for name, row in p["rows"].items():
        print(f"{name:<30}{row['prefill']:>14.1f}{row['decode']:>14.1f}")
    for key, values in p["per_round"].items():
        print(f"{key}: {p['ratios'][key]:.3f} ({min(values):.3f}-{max(values):.3f})")


if __name__ == "__main__":
    sys.exit(main())
