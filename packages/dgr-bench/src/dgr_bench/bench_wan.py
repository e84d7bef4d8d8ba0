"""Routes over simulated WAN links (`dgr_bench.netsim` proxies in front of every worker, so every
link is delayed: coordinator to head, stage to stage, and the tail's tokens back to the head).

`nox -s bench-wan` (DGR-062): decode tokens/s of DGR routes (forward mode with 3 and 2 stages,
relay mode with 3) and of llama.cpp RPC (two ggml-rpc-servers, -ts 1/1) at 0, 1 and 10 ms of
added one-way latency, measured in the same run, each DGR row beside its physical floor: the
whole model's compute per token in one process plus the one-way hops a token must make times
the delay (forward: one per stage, a ring; relay: two per stage). All of it at 2 threads per
process (the alpha protocol's; the gate's metrics) and at 1 (reported with a `_1threads` suffix).
Writes evidence/bench/bench-wan.json.

`nox -s bench-seam` (DGR-053): the seam-cost model. In relay mode a decode token makes one round
trip to every stage; through links of latency d and bandwidth B each stage costs 2·d plus the
bytes it receives and sends divided by B. The model predicts a token's time as the time measured
through zero-latency links plus that sum, and is checked against measurements at 1 and 10 ms,
within 20% (the gate); the same check through a 10 Mbit/s link is reported beside it (the
proxy's pacing in Python is coarse at that rate, so it is not gated). Writes
evidence/bench/bench-seam.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dgr_cli.workers import WorkerProcess, descriptor_args, start_worker
from dgr_records import report, write_bench
from dgr_route.route import Route

from dgr_bench import pinning
from dgr_bench.bench import engine_round, route_round, rpc_servers, time_route
from dgr_bench.netsim import start_link

LAYOUT = [(0, 10), (10, 20), (20, 30)]
PAIR = [(0, 15), (15, 30)]
PROMPT = [1000 + (i * 7) % 5000 for i in range(64)]
DECODE_TOKENS = 64  # as the alpha protocol decodes on loopback
ROUNDS = 5  # paired rounds per row (a round: the floor's compute, then the route), medians
THREADS = (2, 1)  # per process: the protocol's first, then 1 (reported beside it)
PROTOCOL_BYTES = 60  # gRPC/HTTP2 framing and the request's own fields, per message (estimate)


def hops(mode: str, n_stages: int) -> int:
    """One-way trips on a decode token's critical path: forward mode is a ring (each stage to the
    next, the tail back to the head); relay goes to every stage and back."""
    return n_stages if mode == "forward" else 2 * n_stages


@contextmanager
def linked(
    addresses: list[str],
    latency_ms: float,
    mbps: float | None = None,
    accuracy: list[dict[str, float]] | None = None,
) -> Iterator[list[str]]:
    """A simulated link in front of each address; yields the links' addresses, to be reached
    through by the coordinator and the other stages alike. With `accuracy`, each link's
    `LinkProcess.stats` is appended to it when the block ends."""
    links = [start_link(a, latency_ms, mbps, control=accuracy is not None) for a in addresses]
    try:
        yield [link.address for link in links]
        if accuracy is not None:
            accuracy.extend(link.stats() for link in links)
    finally:
        for link in links:
            link.stop()


def through_links(
    workers: list[WorkerProcess], latency_ms: float, mbps: float | None, mode: str = "relay"
) -> float:
    """Seconds per decode token of the route over `workers`, each behind a simulated link."""
    with linked([w.address for w in workers], latency_ms, mbps) as addresses:
        rate = time_route(addresses, PROMPT, DECODE_TOKENS, ROUNDS, mode, peers=addresses)
    return 1 / rate["decode"]


def rpc_decode_tps(bench_bin: Path, model: Path, addresses: list[str], threads: int) -> float:
    out = subprocess.run(
        [
            str(bench_bin),
            "-m",
            str(model),
            "-p",
            "0",
            "-n",
            str(DECODE_TOKENS),
            "-d",
            str(len(PROMPT)),  # decode after a prompt, as the DGR rows do
            "-t",
            str(threads),
            "-r",
            "1",
            "-o",
            "json",
            "--rpc",
            ",".join(addresses),
            "-ngl",
            "99",
            "-ts",
            "1/1",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    return float(json.loads(out.stdout)[0]["avg_ts"])


def hop_bytes(n_embd: int) -> list[int]:
    """Bytes a decode token moves over each stage's link (in + out), f32 boundary."""
    row = n_embd * 4
    sizes = []
    for i in range(len(LAYOUT)):
        into = 4 + (row if i > 0 else 0) + PROTOCOL_BYTES
        out = (row if i < len(LAYOUT) - 1 else 8) + PROTOCOL_BYTES
        sizes.append(into + out)
    return sizes


def wan(
    model: Path,
    workers: list[WorkerProcess],
    pair: list[WorkerProcess],
    threads: int,
    with_rpc: Path,
) -> dict[str, Any]:
    """`workers`: the 3-stage route; `pair`: a 2-stage route, the same number of remote hosts as
    the two RPC servers; every process at `threads`; `with_rpc`: the RPC lane's binaries."""
    from dgr_route.engine import locate

    # the floor's compute is timed beside each route round (the whole model in this process, at
    # the workers' threads): a shared VM drifts over the minutes this takes, and a floor measured
    # once at the start would carry that drift into every ratio
    engine = (
        locate().module().Engine(str(model), 0, -1, n_threads=threads, n_ctx=1024, max_sessions=1)
    )
    engine_round(engine, PROMPT, DECODE_TOKENS)  # untimed: the first graphs
    routes = {
        "dgr_forward_3stage": ("forward", workers),
        "dgr_forward_2stage": ("forward", pair),
        "dgr_relay_3stage": ("relay", workers),
    }
    rows: dict[str, Any] = {}
    computes: list[float] = []
    for latency in (0, 1, 10):
        row: dict[str, Any] = {}
        for name, (mode, fleet) in routes.items():
            n_hops = hops(mode, len(fleet))
            accuracy: list[dict[str, float]] = []
            rounds = paired_through_links(engine, fleet, latency, mode, accuracy)
            computes += [c for c, _ in rounds]
            floors = [c + n_hops * latency / 1000 for c, _ in rounds]
            seconds = statistics.median(s for _, s in rounds)
            floor = statistics.median(floors)
            row[name] = {
                "decode_tps": round(1 / seconds, 2),
                "hops": n_hops,
                "compute_ms_per_token": round(statistics.median(c for c, _ in rounds) * 1000, 3),
                "floor_tps": round(1 / floor, 2),
                "of_floor": round(
                    statistics.median(f / s for f, (_, s) in zip(floors, rounds, strict=True)), 3
                ),
                # how late the links delivered decode-sized chunks against their due time (the
                # median over the links of each one's percentile): the floor takes them as on time
                "link_late_us": {
                    q: statistics.median(a[f"small_late_{q}_us"] for a in accuracy)
                    for q in ("p10", "p50", "p90")
                },
            }
        procs, servers = rpc_servers(with_rpc / "ggml-rpc-server", 2, threads)
        try:
            with linked(servers, latency) as addresses:
                rpc_tps = rpc_decode_tps(with_rpc / "llama-bench", model, addresses, threads)
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)
        row["rpc_2servers_decode_tps"] = round(rpc_tps, 2)
        for name in routes:
            row[name]["over_rpc_2servers"] = round(row[name]["decode_tps"] / rpc_tps, 3)
        rows[f"{latency}ms"] = row
        print(
            f"{threads}t {latency:>3} ms one-way on every link; RPC 2 servers {rpc_tps:.1f} tok/s"
        )
        for name in routes:
            r = row[name]
            print(
                f"    {threads}t {name:<20} {r['decode_tps']:6.1f} tok/s  "
                f"floor {r['floor_tps']:6.1f} "
                f"({r['hops']} hops)  {r['of_floor']:.2f} of floor  "
                f"{r['over_rpc_2servers']:.2f}x RPC  links late "
                f"{r['link_late_us']['p50']:.0f}/{r['link_late_us']['p90']:.0f} us (p50/p90)",
                flush=True,
            )
    rows["compute_ms_per_token"] = round(statistics.median(computes) * 1000, 3)
    print(f"compute: {rows['compute_ms_per_token']:.2f} ms per token (whole model, one process)")
    return rows


def paired_through_links(
    engine: Any,
    workers: list[WorkerProcess],
    latency_ms: float,
    mode: str,
    accuracy: list[dict[str, float]] | None = None,
) -> list[tuple[float, float]]:
    """(compute, route) seconds per decode token, ROUNDS times: the engine in this process and
    the route through delayed links, back to back in each round (`accuracy`: see `linked`)."""
    with linked([w.address for w in workers], latency_ms, accuracy=accuracy) as addresses:
        route = Route.open(addresses, timeout=120, mode=mode, peers=addresses, prefix_reuse=False)
        try:
            out = []
            for _ in range(ROUNDS):
                compute = 1 / engine_round(engine, PROMPT, DECODE_TOKENS)["decode"]
                out.append((compute, 1 / route_round(route, PROMPT, DECODE_TOKENS)["decode"]))
            return out
        finally:
            route.close()


def seam_model(workers: list[WorkerProcess], n_embd: int) -> dict[str, Any]:
    base = through_links(workers, 0, None)
    hops = hop_bytes(n_embd)
    rows: dict[str, Any] = {"base_ms_per_token": round(base * 1000, 3), "hop_bytes": hops}
    worst = 0.0
    for latency, mbps in ((1, None), (10, None), (1, 10.0)):
        measured = through_links(workers, latency, mbps)
        bw = mbps * 1e6 if mbps else None
        predicted_cost = sum(2 * latency / 1000 + (b * 8 / bw if bw else 0.0) for b in hops)
        measured_cost = measured - base
        error = abs(predicted_cost - measured_cost) / measured_cost
        if mbps is None:  # the gate: added latency (a rate-limited link is reported beside it)
            worst = max(worst, error)
        key = f"{latency}ms" + (f"_{mbps:g}mbps" if mbps else "")
        rows[key] = {
            "measured_ms_per_token": round(measured * 1000, 3),
            "predicted_seam_cost_ms": round(predicted_cost * 1000, 3),
            "measured_seam_cost_ms": round(measured_cost * 1000, 3),
            "relative_error": round(error, 3),
        }
        print(
            f"{key:>12}: token {measured * 1000:6.2f} ms (base {base * 1000:.2f}); seam cost "
            f"predicted {predicted_cost * 1000:6.2f} ms, measured {measured_cost * 1000:6.2f} ms, "
            f"error {error:.1%}",
            flush=True,
        )
    rows["worst_relative_error"] = round(worst, 3)  # over the 1 and 10 ms rows
    return rows


def main(argv: list[str] | None = None) -> int:
    from dgr_artifacts.models import model_path

    parser = argparse.ArgumentParser(prog="python -m dgr_bench.bench_wan")
    parser.add_argument("--seam-model", action="store_true", help="calibrate the seam-cost model")
    parser.add_argument("--model", default="smollm2-135m-q4_1")
    parser.add_argument("--threads", type=int, nargs="+", default=list(THREADS))
    parser.add_argument(
        "--pin-stages",
        action="store_true",
        help="each stage (and RPC server) on cores of its own (the gate's host condition)",
    )
    args = parser.parse_args(argv)
    pinning.enable(args.pin_stages)
    model = model_path(args.model)
    descriptor = descriptor_args(model)
    gate: dict[str, float]

    def fleet(layout: list[tuple[int, int]], threads: int) -> list[WorkerProcess]:
        return [
            start_worker(
                model,
                a,
                b,
                descriptor=descriptor,
                threads=threads,
                n_ctx=1024,
                extra=pinning.worker_args(i, threads),
            )
            for i, (a, b) in enumerate(layout)
        ]

    if args.seam_model:
        workers = fleet(LAYOUT, 1)
        try:
            n_embd = int(
                Route.open([w.address for w in workers]).stages[0].describe.boundary.n_embd
            )
            result = {"model": args.model, "layout": LAYOUT, **seam_model(workers, n_embd)}
        finally:
            for w in workers:
                w.stop()
        name, gate = "bench-seam", {"worst_relative_error": result["worst_relative_error"]}
    else:
        from dgr_llamacpp.build import build
        from dgr_llamacpp.workspace import open_workspace

        with_rpc = build(
            open_workspace(), "cpu-rpc", ["llama-bench", "ggml-rpc-server"], log=sys.stderr
        )
        by_threads: dict[str, Any] = {}
        gate = {}
        for threads in args.threads:
            workers = fleet(LAYOUT, threads)
            pair: list[WorkerProcess] = []
            try:
                pair = fleet(PAIR, threads)
                by_latency = wan(model, workers, pair, threads, with_rpc)
            finally:
                for w in workers + pair:
                    w.stop()
            by_threads[str(threads)] = by_latency
            suffix = "" if threads == THREADS[0] else f"_{threads}threads"
            gate |= {
                f"{latency}_{name}_{ratio}{suffix}": row[name][ratio]
                for latency, row in by_latency.items()
                if isinstance(row, dict)
                for name in ("dgr_forward_3stage", "dgr_forward_2stage", "dgr_relay_3stage")
                for ratio in ("of_floor", "over_rpc_2servers")
            }
        result = {
            "model": args.model,
            "layout": LAYOUT,
            "by_threads": by_threads,
            "pinning": pinning.record(len(LAYOUT), max(args.threads)),
        }
        name = "bench-wan"
    result["gate_metrics"] = {name.replace("-", "_"): gate}  # what `dgr-prd gate alpha` reads
    result["measured_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_bench(name, result)
    report(name.replace("-", "_"), gate)
    if args.seam_model and result["worst_relative_error"] > 0.2:
        print(f"SEAM MODEL OFF: worst error {result['worst_relative_error']:.1%} > 20%")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
