"""`nox -s bench-plan` (DGR-057, end to end): plans checked against measurement on loopback.

For each generated scenario: nodes that differ in threads and in a memory limit, each behind a
`dgr_bench.netsim` link of its own generated latency (so a message into node j waits d_j: the
link matrix's column j). Each node's compute is probed at its threads on this machine; the
planner places the real model; the planned route is started (real workers, forward mode,
through the links) and its decode tok/s measured, as is an even split over all the nodes in the
listed order. Checked: the planned route's measured tok/s is within 20% of the prediction; it
beats the even split (or the even split does not fit); every worker's RSS after a generation, as
its own metrics report it (/metrics.json, the tracker's view), is within its node's memory.
Writes evidence/bench/bench-plan.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
from dgr_placement import planner
from dgr_placement.nodes import Compute, Links, Node, NodesFile
from dgr_placement.profile import ModelProfile, WorkerOptions, one_way_ms, probe, profile_model

PROMPT = [1000 + (i * 7) % 5000 for i in range(48)]
DECODE_TOKENS = 32
ROUNDS = 3
TOLERANCE = 0.20
OPTIONS = WorkerOptions(n_ctx=256, max_sessions=1)
MIB = 2**20


def loopback_nodes(seed: int, profile: ModelProfile, n_nodes: int) -> NodesFile:
    """Nodes on this machine: 1 or 2 threads, a link latency in front of each (0.5-6 ms) and a
    memory limit: one node can hold a tail (the logits buffer) of 20-40% of the layers, the
    others a head of 25-50%, so that the model needs 3 stages or more and plans differ."""
    rng = np.random.default_rng(seed)
    n = profile.n_layer
    tail_node = int(rng.integers(0, n_nodes))
    nodes = []
    for i in range(n_nodes):
        if i == tail_node:
            limit = profile.stage_bytes(n - max(1, int(n * rng.uniform(0.2, 0.4))), n)
        else:
            limit = profile.stage_bytes(0, max(1, int(n * rng.uniform(0.25, 0.5))))
        nodes.append(
            Node(
                name=f"node{i}",
                listen=f"127.0.0.1:{7300 + i}",
                memory_mib=round(limit * (1 + planner.DEFAULT_MARGIN) / MIB + 1, 1),
                threads=int(rng.choice([1, 2])),
            )
        )
    delay = [round(float(rng.uniform(0.5, 6.0)), 2) for _ in range(n_nodes)]
    latency = [[0.0 if i == j else delay[j] for j in range(n_nodes)] for i in range(n_nodes)]
    return NodesFile(nodes=nodes, links=Links(latency_ms=latency))


def measured_links(model: Path, nodes: NodesFile) -> NodesFile:
    """The link matrix as a deployment would measure it (`one_way_ms` through each node's link,
    median of 30), in front of a one-layer worker."""
    from dgr_cli.workers import start_worker

    from dgr_bench.netsim import start_link

    size = len(nodes.nodes)
    target = start_worker(model, 0, 1, threads=1, n_ctx=64, max_sessions=1)
    one_way = []
    try:
        for j in range(size):
            link = start_link(target.address, max(row[j] for row in nodes.links.latency_ms))
            try:
                one_way.append(round(one_way_ms(link.address, calls=30), 3))
            finally:
                link.stop()
    finally:
        target.stop()
    latency = [[0.0 if i == j else one_way[j] for j in range(size)] for i in range(size)]
    return nodes.model_copy(update={"links": Links(latency_ms=latency)})


def even_split(problem: planner.Problem) -> list[tuple[int, int, int]]:
    """All the nodes in their listed order, layers split as evenly as the parity harness does."""
    from dgr_route.local import even_layout

    return [(i, a, b) for i, (a, b) in enumerate(even_layout(problem.n_layer, problem.size))]


def scrape(worker: Any) -> dict[str, Any]:
    """What the worker's /metrics.json told the tracker after the generations: its measured
    RSS, the tokens and forwards it computed and its mean forward time."""
    from dgr_meshnet.collect import metrics_view

    m = metrics_view(worker.metrics_url)
    latency = m["dgr:forward_latency_seconds"]
    return {
        "rss_bytes": int(m["process_resident_memory_bytes"]),
        "prompt_tokens": m["dgr:prompt_tokens_total"],
        "generation_tokens": m["dgr:generation_tokens_total"],
        "forwards": m["dgr:forwards_total"],
        "mean_forward_ms": round(1000 * latency["sum"] / max(1, latency["count"]), 3),
    }


def measure(
    model: Path, nodes: NodesFile, nominal: NodesFile, stages: list[tuple[int, int, int]]
) -> dict[str, Any]:
    """Start the workers of `stages`, each behind its node's link; decode tok/s (median of
    ROUNDS) through the route in forward mode, and each worker's RSS afterwards."""
    from dgr_cli.workers import descriptor_args, start_worker

    from dgr_bench.bench import time_route
    from dgr_bench.netsim import start_link

    descriptor = descriptor_args(model)
    workers, links = [], []
    try:
        for node, first, last in stages:
            workers.append(
                start_worker(
                    model,
                    first,
                    last,
                    threads=nodes.nodes[node].threads,
                    n_ctx=OPTIONS.n_ctx,
                    n_batch=OPTIONS.n_batch,
                    max_sessions=OPTIONS.max_sessions,
                    descriptor=descriptor,
                    extra=["--metrics-listen", "127.0.0.1:0"],
                )
            )
            # a message into this node waits the delay of the link in front of it
            delay = max((row[node] for row in nominal.links.latency_ms), default=0.0)
            links.append(start_link(workers[-1].address, delay))
        addresses = [link.address for link in links]
        rate = time_route(addresses, PROMPT, DECODE_TOKENS, ROUNDS, "forward", peers=addresses)
        return {"decode_tps": round(rate["decode"], 3), "metrics": [scrape(w) for w in workers]}
    finally:
        for link in links:
            link.stop()
        for w in workers:
            w.stop()


def run_scenario(
    model: Path, profile: ModelProfile, seed: int, n_nodes: int, probes: dict[int, Compute]
) -> dict[str, Any]:
    """`probes`: each thread count's compute, probed once for the run (as a node is probed once
    and its line kept in nodes.yaml), filled in as thread counts appear."""
    nominal = loopback_nodes(seed, profile, n_nodes)
    nodes = measured_links(model, nominal)
    for node in nodes.nodes:
        if node.threads not in probes:
            probes[node.threads] = probe(model, node.threads)
    computes = [probes[n.threads] for n in nodes.nodes]
    problem = planner.Problem(profile, nodes, computes, "f32")
    best = planner.plan(problem)
    stages = [(s.node, s.first, s.last) for s in best.stages]
    planned = measure(model, nodes, nominal, stages)
    error = abs(planned["decode_tps"] - best.tok_s) / best.tok_s
    fits = [
        m["rss_bytes"] <= nodes.nodes[node].memory_bytes
        for m, (node, _, _) in zip(planned["metrics"], stages, strict=True)
    ]
    even = even_split(problem)
    even_latency, _ = problem.evaluate(even)
    row: dict[str, Any] = {
        "seed": seed,
        "nodes": [
            {
                "name": n.name,
                "threads": n.threads,
                "memory_mib": n.memory_mib,
                "link_ms": max(r[i] for r in nominal.links.latency_ms),
                "link_measured_ms": max(r[i] for r in nodes.links.latency_ms),
                "compute": computes[i].model_dump(),
            }
            for i, n in enumerate(nodes.nodes)
        ],
        "plan": [
            {
                "node": nodes.nodes[s.node].name,
                "layers": [s.first, s.last],
                "estimate_mib": round(s.memory_bytes / MIB, 1),
                "rss_mib": round(m["rss_bytes"] / MIB, 1),
                "compute_ms": round(s.compute_ms, 3),
                "hop_ms": round(s.hop_ms, 3),
                "metrics": m,
            }
            for s, m in zip(best.stages, planned["metrics"], strict=True)
        ],
        "predicted_tps": round(best.tok_s, 3),
        "measured_tps": planned["decode_tps"],
        "relative_error": round(error, 4),
        "within_tolerance": bool(error <= TOLERANCE),
        "every_stage_fits": bool(all(fits)),
        "even_split": [[nodes.nodes[i].name, a, b] for i, a, b in even],
    }
    if even_latency == planner.INF:
        row["even_split_fits"] = False
        row["beats_even_split"] = True  # the even split would not fit
    else:
        measured_even = measure(model, nodes, nominal, even)
        row["even_split_fits"] = True
        row["even_predicted_tps"] = round(1000 / even_latency, 3)
        row["even_measured_tps"] = measured_even["decode_tps"]
        row["beats_even_split"] = bool(planned["decode_tps"] > measured_even["decode_tps"])
    return row


def main(argv: list[str] | None = None) -> int:
    from dgr_artifacts.manifest import build_manifest
    from dgr_artifacts.models import model_path
    from dgr_records import report, write_bench

    parser = argparse.ArgumentParser(prog="python -m dgr_bench.plan")
    parser.add_argument("--model", default="smollm2-135m-q4_1")
    parser.add_argument(
        "--scenarios",
        nargs="+",
        default=["2:4", "3:4", "8:3", "1:3"],
        help="SEED:NODES of each generated scenario",
    )
    args = parser.parse_args(argv)
    model = model_path(args.model)
    profile = profile_model(model, build_manifest(model), OPTIONS)
    rows = []
    probes: dict[int, Compute] = {}
    for spec in args.scenarios:
        seed, n_nodes = (int(x) for x in spec.split(":"))
        row = run_scenario(model, profile, seed, n_nodes, probes)
        rows.append(row)
        plan = ", ".join(f"{p['node']} {p['layers'][0]}:{p['layers'][1]}" for p in row["plan"])
        even = (
            f"even split {row['even_measured_tps']:.1f} tok/s measured"
            if row["even_split_fits"]
            else "even split does not fit"
        )
        print(
            f"seed {seed}: plan [{plan}] predicted {row['predicted_tps']:.1f} tok/s, measured "
            f"{row['measured_tps']:.1f} ({row['relative_error']:.1%} off); {even}; "
            f"fits: {row['every_stage_fits']}",
            flush=True,
        )
    worst = max(r["relative_error"] for r in rows)
    ok = all(
        r["within_tolerance"] and r["every_stage_fits"] and r["beats_even_split"] for r in rows
    )
    result = {
        "model": args.model,
        "options": OPTIONS.model_dump(),
        "tolerance": TOLERANCE,
        "probes": {str(t): c.model_dump() for t, c in sorted(probes.items())},
        "scenarios": rows,
        "worst_relative_error": worst,
        "median_relative_error": round(statistics.median(r["relative_error"] for r in rows), 4),
        "passes": ok,
    }
    write_bench("bench-plan", result)
    report(
        "bench_plan",
        {
            "worst_relative_error": worst,
            "beats_even_split": all(r["beats_even_split"] for r in rows),
            "every_stage_fits": all(r["every_stage_fits"] for r in rows),
        },
    )
    print(f"worst prediction error {worst:.1%} (tolerance {TOLERANCE:.0%}); passes: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
