"""Speculative decoding through the route: decode with and without prompt-lookup drafts.

`nox -s bench-spec` (issue 14, the DGR-069 bench's lookup half): a 3-stage forward-mode route
of SmolLM2 on loopback and behind simulated links of 10 ms one-way on every link
(`dgr_bench.netsim` proxies, reached by the coordinator and the stages alike), at 1 and 2
threads per worker. Two tasks: a repetitive one (quote a given text), where drafts from the
prompt should be accepted, and a free-form one, where they mostly are not and the head's
controller should stop drafting. Plain and drafted generations alternate round by round over
the same workers, so the ratio of a round sees one machine state (which goes first alternates
from round to round).

Every row reports decode tokens/s both ways, the speed-up, the acceptance rate (drafts accepted
per draft verified), tokens per route trip, and, behind links, the physical floor of plain
decode (the whole model's compute per token in one process plus 3 one-way hops times the
delay). Greedy output must equal plain decode token for token; a difference fails the bench.
Beside the rows, per thread count, what one verifying forward of 1, 2, 4 and 9 tokens costs the
whole model in one process (`verify_ms`): the price of a draft, which bounds what drafting can
gain where the trip is cheap.
Writes evidence/bench/bench-spec.json.

`-- --sweep` instead caps the head's draft length at each of SWEEP_CAPS on the repetitive task
behind 10 ms links (the controller still adapts below the cap): whether any fixed ceiling beats
what the controller chose. Writes evidence/bench/bench-spec-sweep.json.

MTP drafts on the V4 twin (the other half of DGR-069, the beta gate's metric) are measured the
same way by `nox -s bench-mtp` (dgr_bench.mtp).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from dgr_cli.workers import WorkerProcess, descriptor_args, start_worker
from dgr_records import report, write_bench
from dgr_route.route import Draft, DraftUsage, Route

from dgr_bench.bench import engine_round
from dgr_bench.bench_wan import linked

LAYOUT = [(0, 10), (10, 20), (20, 30)]
DECODE_TOKENS = 64
ROUNDS = 5
SWEEP_CAPS = (1, 2, 4, 8, 16)
VERIFY_ROWS = (1, 2, 4, 9)  # tokens in one verifying forward: the last accepted + drafts
LATENCIES_MS = (0, 10)
THREADS = (1, 2)
QUOTED = (
    "The committee met on Tuesday to review the budget for the new library. After a long "
    "discussion, the members agreed to fund the reading room, the children's section and the "
    "archive, but postponed the café until next year. The chair thanked the volunteers who had "
    "catalogued more than four thousand books over the summer."
)
TASKS = {
    "repetitive": f"Repeat the following text exactly.\n\n{QUOTED}\n\nRepeated text:\n",
    "free_form": "Write a short story about a lighthouse keeper who finds a strange map.\n\n",
}


def generation(route: Route, prompt: list[int]) -> tuple[list[int], float, DraftUsage]:
    """Greedy tokens, decode seconds (after the first token) and what drafting did."""
    usage = DraftUsage()
    stream = route.results(prompt, DECODE_TOKENS + 1, usage=usage)
    tokens = [int(next(stream).token_id)]
    t0 = time.perf_counter()
    tokens += [int(r.token_id) for r in stream]
    return tokens, time.perf_counter() - t0, usage


def verify_ms(engine: Any, prompt: list[int], repeats: int = 15) -> dict[str, float]:
    """Median milliseconds of one forward of n tokens with logits for every row, after the prompt
    (what the tail computes to verify n - 1 drafts), for each n in VERIFY_ROWS."""
    import numpy as np

    engine.forward(1, 1, 0, tokens=np.array(prompt, np.int32))
    costs = {}
    for n in VERIFY_ROWS:
        rows = np.array(prompt[:n], np.int32)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.forward(1, 1, len(prompt), tokens=rows, logits_all=True, truncate=True)
            times.append(time.perf_counter() - t0)
        costs[str(n)] = round(1000 * statistics.median(times), 2)
    engine.release(1)
    return costs


def compare(
    addresses: list[str],
    prompts: dict[str, list[int]],
    engine: Any,
    latency_ms: float,
    draft: Draft | None = None,
    n_rounds: int = ROUNDS,
) -> dict[str, Any]:
    """Plain and drafted generation of every task, alternating, ROUNDS rounds: one row per task
    (drafts from prompt lookup unless `draft` says otherwise)."""
    plain = Route.open(addresses, timeout=120, peers=addresses)
    drafted = Route.open(addresses, timeout=120, peers=addresses, draft=draft or Draft("lookup"))
    rows: dict[str, Any] = {}
    try:
        for task, prompt in prompts.items():
            # untimed, each route once: the first graphs of this prompt's shapes, and for the
            # drafted route what its steps cost (the head keeps that per route, DraftCosts: a
            # route's first generation drafts from a prior until it has timed its steps)
            generation(plain, prompt)
            generation(drafted, prompt)
            rounds = []
            for k in range(n_rounds):
                compute = 1 / engine_round(engine, prompt, 16)["decode"]
                # which goes first alternates: the first after the in-process round starts colder
                if k % 2 == 0:
                    ref, t_plain, _ = generation(plain, prompt)
                    out, t_spec, usage = generation(drafted, prompt)
                else:
                    out, t_spec, usage = generation(drafted, prompt)
                    ref, t_plain, _ = generation(plain, prompt)
                if out != ref:
                    raise AssertionError(f"{task}: drafted output differs from plain decode")
                rounds.append((compute, t_plain, t_spec, usage))
            n = DECODE_TOKENS
            drafted_n = sum(u.drafted for *_, u in rounds)
            accepted_n = sum(u.accepted for *_, u in rounds)
            steps = len(rounds) * (n + 1) - accepted_n  # every trip yields 1 + its accepted drafts
            floor = statistics.median(c + len(addresses) * latency_ms / 1000 for c, *_ in rounds)
            rows[task] = {
                "plain_tps": round(n / statistics.median(r[1] for r in rounds), 2),
                "drafted_tps": round(n / statistics.median(r[2] for r in rounds), 2),
                # the geometric mean of the paired rounds' ratios
                "speedup": round(statistics.geometric_mean(r[1] / r[2] for r in rounds), 3),
                "acceptance": round(accepted_n / drafted_n, 3) if drafted_n else 0.0,
                "drafted": drafted_n,
                "accepted": accepted_n,
                "tokens_per_trip": round(len(rounds) * (n + 1) / steps, 3),
                "plain_floor_tps": round(1 / floor, 2),
                # how far plain decode moved between rounds: the noise the ratio carries
                "plain_spread": round(max(r[1] for r in rounds) / min(r[1] for r in rounds) - 1, 3),
                "outputs_equal": True,
            }
    finally:
        plain.close()
        drafted.close()
    return rows


def by_link(
    direct: list[str],
    prompts: dict[str, list[int]],
    engine: Any,
    threads: int,
    gate: dict[str, float],
) -> dict[str, Any]:
    """Every task on loopback and behind each of LATENCIES_MS, its speed-ups put into `gate`."""
    by_latency: dict[str, Any] = {}
    for latency in LATENCIES_MS:
        if latency == 0:  # loopback: no proxy in the way
            rows = compare(direct, prompts, engine, latency)
        else:
            with linked(direct, latency) as addresses:
                rows = compare(addresses, prompts, engine, latency)
        by_latency[f"{latency}ms"] = rows
        for task, r in rows.items():
            print(
                f"{threads}t {latency:>2} ms {task:<10} plain {r['plain_tps']:6.1f} "
                f"drafted {r['drafted_tps']:6.1f} tok/s  x{r['speedup']:.2f}  "
                f"acceptance {r['acceptance']:.2f}  {r['tokens_per_trip']:.2f} tok/trip  "
                f"plain floor {r['plain_floor_tps']:.1f}",
                flush=True,
            )
            gate[f"{threads}t_{latency}ms_{task}_speedup"] = r["speedup"]
    return by_latency


def sweep(
    direct: list[str], prompts: dict[str, list[int]], engine: Any, threads: int
) -> dict[str, Any]:
    """The repetitive task behind 10 ms links with max_draft capped at each of SWEEP_CAPS."""
    rows: dict[str, Any] = {}
    with linked(direct, 10) as addresses:
        for cap in SWEEP_CAPS:
            draft = Draft("lookup", max_draft=cap)
            task = {"repetitive": prompts["repetitive"]}
            r = compare(addresses, task, engine, 10, draft)["repetitive"]
            rows[f"max_draft_{cap}"] = r
            print(
                f"{threads}t 10 ms repetitive max_draft {cap:>2}: x{r['speedup']:.2f}  "
                f"{r['tokens_per_trip']:.2f} tok/trip  acceptance {r['acceptance']:.2f}",
                flush=True,
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    from dgr_artifacts.models import model_path
    from dgr_route.engine import locate

    parser = argparse.ArgumentParser(prog="python -m dgr_bench.spec")
    parser.add_argument("--model", default="smollm2-135m-q4_1")
    parser.add_argument("--threads", type=int, nargs="+", default=list(THREADS))
    parser.add_argument("--sweep", action="store_true", help="cap max_draft, 10 ms, repetitive")
    args = parser.parse_args(argv)
    model = model_path(args.model)
    descriptor = descriptor_args(model)
    vocab = locate().module().Vocabulary(str(model))
    prompts = {task: list(vocab.tokenize(text)) for task, text in TASKS.items()}
    result: dict[str, Any] = {
        "model": args.model,
        "layout": LAYOUT,
        "decode_tokens": DECODE_TOKENS,
        "rounds": ROUNDS,
        "draft": vars(Draft("lookup")),
        "by_threads": {},
    }
    gate: dict[str, float] = {}
    for threads in args.threads:
        engine = (
            locate()
            .module()
            .Engine(str(model), 0, -1, n_threads=threads, n_ctx=1024, max_sessions=1)
        )
        verify = verify_ms(engine, prompts["repetitive"])
        print(f"{threads}t verifying forward of n tokens, in process: {verify} ms", flush=True)
        workers: list[WorkerProcess] = [
            start_worker(model, a, b, descriptor=descriptor, threads=threads, n_ctx=1024)
            for a, b in LAYOUT
        ]
        direct = [w.address for w in workers]
        try:
            if args.sweep:
                by_latency = sweep(direct, prompts, engine, threads)
            else:
                by_latency = by_link(direct, prompts, engine, threads, gate)
        finally:
            for w in workers:
                w.stop()
            del engine
        result["by_threads"][str(threads)] = {"verify_ms": verify, **by_latency}
    if args.sweep:
        result["measured_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        write_bench("bench-spec-sweep", result)
        return 0
    gate["lookup_speedup_min"] = min(gate.values())
    result["gate_metrics"] = {"bench_spec": gate}
    result["measured_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_bench("bench-spec", result)
    report("bench_spec", gate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
