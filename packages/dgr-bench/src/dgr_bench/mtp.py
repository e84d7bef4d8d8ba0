"""MTP drafting through the route: decode with and without the tail's MTP drafts (DGR-069).

`nox -s bench-mtp`: a 3-stage forward-mode route of the generated DeepSeek V4 quick twin, whose
tail serves the MTP block (--mtp), on loopback and behind simulated links of 10 ms one-way on
every link, at 1 and 2 threads per worker, as `dgr_bench.spec` measures prompt-lookup drafts:
plain and drafted generations alternate round by round over the same workers, greedy output must
equal plain decode token for token, and every row reports decode tokens/s both ways, the
speed-up, the acceptance rate, tokens per route trip and, behind links, plain decode's physical
floor. Two prompts: a random token sequence and the same sequence repeated (the twin has no
language to repeat).

The twin's weights are random, so its MTP block rarely guesses the next token: the acceptance it
records is the twin's, not a claim about DeepSeek V4's trained block, and what the rows show is
the price of drafting that does not pay: the head's controller should stop asking for drafts
after a few, probing now and then. The beta gate's `mtp.speedup_vs_plain_decode` (>= 1.0: MTP
drafting never slows decode down) is the geometric mean of the rows' speed-ups, each itself the
geometric mean of ROUNDS paired rounds; the smallest row is recorded beside it
(`speedup_min_row`), and so is how far plain decode itself moved between rounds
(`plain_spread`), the noise any one row carries on this machine. Writes
evidence/bench/bench-mtp.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np
from dgr_cli.workers import WorkerProcess, descriptor_args, start_worker
from dgr_records import report, write_bench
from dgr_route.route import Draft

from dgr_bench import spec
from dgr_bench.bench_wan import linked

TWIN = "dsv4-twin-quick"
LAYOUT = [(0, 2), (2, 4), (4, 6)]
MAX_DRAFT = 4
ROUNDS = 5


def prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(69)
    segment = [int(t) for t in rng.integers(0, 1024, 40)]
    return {"repetitive": segment * 3, "free_form": [int(t) for t in rng.integers(0, 1024, 120)]}


def main(argv: list[str] | None = None) -> int:
    from dgr_native.twins import twin_path
    from dgr_route.engine import locate

    parser = argparse.ArgumentParser(prog="python -m dgr_bench.mtp")
    parser.add_argument("--threads", type=int, nargs="+", default=list(spec.THREADS))
    args = parser.parse_args(argv)
    model = twin_path(TWIN)
    descriptor = descriptor_args(model)
    draft = Draft("mtp", max_draft=MAX_DRAFT)
    tasks = prompts()
    result: dict[str, Any] = {
        "model": TWIN,
        "layout": LAYOUT,
        "decode_tokens": spec.DECODE_TOKENS,
        "rounds": ROUNDS,
        "draft": vars(draft),
        "by_threads": {},
    }
    rows_seen: list[dict[str, Any]] = []
    for threads in args.threads:
        engine = (
            locate()
            .module()
            .Engine(str(model), 0, -1, n_threads=threads, n_ctx=1024, max_sessions=1)
        )
        workers: list[WorkerProcess] = [
            start_worker(
                model,
                a,
                b,
                descriptor=descriptor,
                threads=threads,
                n_ctx=1024,
                extra=["--mtp"] if b == LAYOUT[-1][1] else [],
            )
            for a, b in LAYOUT
        ]
        by_latency: dict[str, Any] = {}
        try:
            for latency in spec.LATENCIES_MS:
                direct = [w.address for w in workers]
                if latency == 0:
                    rows = spec.compare(direct, tasks, engine, latency, draft, ROUNDS)
                else:
                    with linked(direct, latency) as addresses:
                        rows = spec.compare(addresses, tasks, engine, latency, draft, ROUNDS)
                by_latency[f"{latency}ms"] = rows
                for task, r in rows.items():
                    rows_seen.append(r)
                    print(
                        f"{threads}t {latency:>2} ms {task:<10} plain {r['plain_tps']:6.1f} "
                        f"mtp {r['drafted_tps']:6.1f} tok/s  x{r['speedup']:.2f}  "
                        f"acceptance {r['acceptance']:.2f} ({r['accepted']}/{r['drafted']})  "
                        f"{r['tokens_per_trip']:.2f} tok/trip  "
                        f"plain floor {r['plain_floor_tps']:.1f}",
                        flush=True,
                    )
        finally:
            for w in workers:
                w.stop()
            del engine
        result["by_threads"][str(threads)] = by_latency
    drafted = sum(r["drafted"] for r in rows_seen)
    accepted = sum(r["accepted"] for r in rows_seen)
    speedups = [r["speedup"] for r in rows_seen]
    gate = {
        "speedup_vs_plain_decode": round(statistics.geometric_mean(speedups), 3),
        "speedup_min_row": min(speedups),
        "plain_spread": max(r["plain_spread"] for r in rows_seen),
        "acceptance": round(accepted / drafted, 3) if drafted else 0.0,
        "drafted": drafted,
        "accepted": accepted,
    }
    result["gate_metrics"] = {"mtp": gate}
    result["measured_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_bench("bench-mtp", result)
    report("mtp", gate)
    print(
        f"mtp.speedup_vs_plain_decode {gate['speedup_vs_plain_decode']:.3f} (geometric mean of "
        f"{len(rows_seen)} rows, the smallest {gate['speedup_min_row']:.3f}, plain decode moving "
        f"up to {gate['plain_spread']:.3f} between rounds; beta gate >= 1.0), acceptance "
        f"{gate['acceptance']:.3f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
