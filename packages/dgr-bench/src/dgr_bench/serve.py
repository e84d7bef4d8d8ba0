"""Serving many users over one route (issue 47): `nox -s bench-serve`.

One run, one 3-stage SmolLM2 forward route of real workers at 2 threads each, `dgr serve`'s app
(dgr_serve.openai_server, under uvicorn) in front of it:

- chat: an 8-turn conversation through /v1/chat/completions, streamed, greedy, each turn adding
  a user message of about 40 tokens and 32 generated. Time to first token per turn, with prefix
  reuse (the route's default) and, in the same run over the same workers, with every turn
  prefilled in full (Route(prefix_reuse=False), what `dgr serve` did before). Gate:
  `ttft_turn8_over_turn1` (reuse) <= 1.5 and `cached_tokens_turn8` >= the tokens of the turns
  before it; both conversations must produce the same text. Beside them, the same conversation
  through the pinned build's llama-server (one process, the whole model, the same threads and
  context, one slot, its prompt cache on as it ships): its turn 8 over turn 1 and its cached
  tokens, the reference the issue names.
- aggregate: K sessions (1, 4, 8) generating 48 tokens each at once, every worker behind a
  simulated link (dgr_bench.netsim) of 0 and 10 ms one-way; aggregate decode tok/s over one
  session's. Beside each row, the physical floor of one session (the whole model's compute per
  token in one process plus 3 one-way hops times the delay) and K times it, and the host's
  ceiling: K sessions' aggregate with no delay at all over one session's behind the links
  (where the cores, not the links, set the bound). At 2 threads per worker (the gate's figures)
  and at 1, each on workers of its own. The workers as they ship (`--convoy auto`) keep
  concurrent sessions one convoy (one llama_decode around the ring, which pays where the stages
  share the cores and the links are short) until their head measures links that take more than a
  quarter of the stages' compute, and send them apart from then on (a convoy leaves every stage
  idle while it is on a link). Beside them, at both delays, workers that always keep the convoy
  (`--convoy always`, what they did before), and at 10 ms workers that never wait to gather one
  (`--gather-us 0`): every set started at once and timed in 3 interleaved rounds, the median
  of each figure kept (the VM drifts more over minutes than the sets differ).
- health: /health latency while 64 requests wait for admission (max_active 4), p50 and p99.

Writes evidence/bench/bench-serve.json with the host's core count; `gate_metrics` holds the
issue's figures. Prints a table as it goes. Exit 1 when a figure misses its threshold.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from dgr_cli.workers import WorkerProcess, descriptor_args, start_worker
from dgr_records import report, write_bench
from dgr_route.route import Route

from dgr_bench.bench import engine_round, sessions_at_once, wait_listening
from dgr_bench.bench_wan import linked

LAYOUT = [(0, 10), (10, 20), (20, 30)]
THREADS = 2
TURNS = 8
REPLY_TOKENS = 32
SESSION_TOKENS = 48
SESSIONS = (1, 4, 8)
LATENCIES_MS = (0, 10)
QUEUED = 64
TOKENIZER: list[Any] = []  # the model's (main sets it)
THRESHOLDS = {  # what the issue asks; the gate reads these figures from gate_metrics
    "ttft_turn8_over_turn1": ("<=", 1.5),
    "aggregate_4_over_1_at_10ms": (">=", 3.5),
    "aggregate_8_over_1_at_10ms": (">=", 6.0),
    "health_p99_ms_64_queued": ("<", 100.0),
}
USER_TURNS = [
    "Tell me about the history of the lighthouse on the northern cliffs and who kept it.",
    "What did the keeper do during the great storm of that winter, and who helped him?",
    "Describe the village below the cliffs: its harbour, its market and its people.",
    "Why did the ships stop coming to the harbour after the railway reached the coast?",
    "What happened to the keeper's daughter when she left the village for the city?",
    "How did the village change when the first tourists arrived in the summer months?",
    "What do the old fishermen say about the light that still shines on stormy nights?",
    "Finish the story: what became of the lighthouse, the village and the keeper's family?",
]


@contextmanager
def serving(route: Route, max_active: int | None = None, max_queue: int = 16) -> Iterator[str]:
    """dgr serve's app over `route` on a free local port; yields its base URL."""
    from dgr_serve.inprocess import serving as in_thread
    from dgr_serve.openai_server import create_app

    with in_thread(create_app(route, TOKENIZER[0], "bench", max_active, max_queue)) as base:
        yield base


def post_stream(base: str, body: dict[str, Any]) -> tuple[float, str, dict[str, Any]]:
    """POST a streamed chat completion; (seconds to the first content, text, usage)."""
    url = urlparse(base)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=600)
    t0 = time.perf_counter()
    conn.request(
        "POST",
        "/v1/chat/completions",
        json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}),
        {"Content-Type": "application/json"},
    )
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
    first, texts, usage = 0.0, [], {}
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(f"stream error: {event['error']}")
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices", []):
            piece = choice.get("delta", {}).get("content")
            if piece:
                first = first or time.perf_counter() - t0
                texts.append(piece)
    conn.close()
    return first, "".join(texts), usage


def chat(base: str) -> list[dict[str, Any]]:
    """The 8-turn conversation; one row per turn."""
    messages = [{"role": "system", "content": "You are a storyteller. Answer in full sentences."}]
    rows = []
    for user in USER_TURNS[:TURNS]:
        messages.append({"role": "user", "content": user})
        ttft, text, usage = post_stream(
            base,
            {
                "model": "bench",
                "messages": messages,
                "max_tokens": REPLY_TOKENS,
                "temperature": 0,
            },
        )
        messages.append({"role": "assistant", "content": text})
        rows.append(
            {
                "ttft_ms": round(ttft * 1000, 1),
                "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                "text": text,
            }
        )
    return rows


def chats(addresses: list[str]) -> dict[str, Any]:
    """The conversation with prefix reuse and with full prefills, twice each, alternating; the
    second of each pair is kept (the first warms the graphs of this conversation's shapes)."""
    out: dict[str, Any] = {}
    for name, reuse in (("full", False), ("reuse", True), ("full", False), ("reuse", True)):
        route = Route.open(addresses, timeout=300, prefix_reuse=reuse)
        try:
            with serving(route) as base:
                out[name] = chat(base)
        finally:
            route.close()
    if [r["text"] for r in out["full"]] != [r["text"] for r in out["reuse"]]:
        raise AssertionError("the conversation with prefix reuse differs from full prefills")
    for name in ("full", "reuse"):
        for i, r in enumerate(out[name], 1):
            print(
                f"chat {name:<5} turn {i}: ttft {r['ttft_ms']:7.1f} ms  prompt "
                f"{r['prompt_tokens']:4d}  cached {r['cached_tokens']:4d}",
                flush=True,
            )
    return out


@contextmanager
def llama_server(model: Path) -> Iterator[str]:
    """The pinned build's llama-server over `model` on a free local port, once it answers
    /health (it listens while it loads); yields its base URL. Built on first use (the bench's
    `reference` extra: dgr-llamacpp)."""
    import socket

    from dgr_llamacpp.build import tool
    from dgr_llamacpp.workspace import open_workspace

    binary = tool(open_workspace(), "llama-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-t", str(THREADS), "-tb", str(THREADS), "-c", "2048", "-np", "1", "--no-webui"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_listening(proc, f"127.0.0.1:{port}")
        deadline = time.monotonic() + 120
        while True:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/health")
            status = conn.getresponse().status
            conn.close()
            if status == 200:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not become ready (HTTP {status})")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def llama_server_chat(model: Path) -> list[dict[str, Any]]:
    """The conversation through llama-server, on two fresh servers in turn; the second is kept
    (as with the route, the first warms; a fresh server, so that its turn 1 finds no cache)."""
    rows: list[dict[str, Any]] = []
    for _ in range(2):
        with llama_server(model) as base:
            rows = chat(base)
    for i, r in enumerate(rows, 1):
        print(
            f"chat llama-server turn {i}: ttft {r['ttft_ms']:7.1f} ms  prompt "
            f"{r['prompt_tokens']:4d}  cached {r['cached_tokens']:4d}",
            flush=True,
        )
    return rows


def aggregate(addresses: list[str], n: int) -> float:
    """Aggregate decode tok/s of n sessions generating SESSION_TOKENS each at once (no prefix
    reuse), the second of two rounds (the first warms the batch shapes)."""
    route = Route.open(addresses, timeout=300, peers=addresses, prefix_reuse=False)
    try:
        sessions_at_once(route, n, SESSION_TOKENS)
        return sessions_at_once(route, n, SESSION_TOKENS)
    finally:
        route.close()


def aggregates(
    workers: list[WorkerProcess], compute_s: float, latencies: tuple[int, ...] = LATENCIES_MS
) -> dict[str, Any]:
    direct = [w.address for w in workers]
    rows: dict[str, Any] = {}
    for latency in latencies:
        floor = 1 / (compute_s + len(workers) * latency / 1000)
        if latency == 0:
            rates = {n: aggregate(direct, n) for n in SESSIONS}
        else:
            with linked(direct, latency) as addresses:
                rates = {n: aggregate(addresses, n) for n in SESSIONS}
        row = {
            "floor_tps_1_session": round(floor, 2),
            **{f"{n}_sessions_tps": round(r, 2) for n, r in rates.items()},
            **{f"{n}_over_1": round(r / rates[1], 3) for n, r in rates.items() if n > 1},
            **{f"{n}_floor_tps": round(n * floor, 2) for n in SESSIONS if n > 1},
        }
        rows[f"{latency}ms"] = row
        print(
            f"aggregate {latency:>2} ms: "
            + "  ".join(f"{n}: {r:6.1f} tok/s" for n, r in rates.items())
            + f"  (x{row['4_over_1']:.2f}, x{row['8_over_1']:.2f}; one session's floor "
            f"{floor:.1f} tok/s)",
            flush=True,
        )
    return rows


def route_workers(
    model: Path, descriptor: list[str], threads: int, extra: list[str] | None = None
) -> list[WorkerProcess]:
    """The bench's route: a worker per range of LAYOUT, `threads` each, room for 8 sessions."""
    return [
        start_worker(
            model,
            a,
            b,
            descriptor=descriptor,
            threads=threads,
            n_ctx=2048,
            max_sessions=8,
            extra=extra,
        )
        for a, b in LAYOUT
    ]


def compute_per_token(model: Path, threads: int) -> float:
    """Seconds per decode token of the whole model through the engine in this process."""
    from dgr_route.engine import locate

    engine = locate().module().Engine(str(model), n_threads=threads, n_ctx=1024, max_sessions=1)
    prompt = [1000 + (i * 7) % 5000 for i in range(32)]
    return statistics.median(
        1 / engine_round(engine, prompt, SESSION_TOKENS)["decode"] for _ in range(3)
    )


# the worker sets the aggregate rows compare: as they ship, always a convoy, never gathering one
MODES: tuple[tuple[str, tuple[int, ...], list[str]], ...] = (
    ("gather", LATENCIES_MS, []),
    ("convoy_always", LATENCIES_MS, ["--convoy", "always"]),
    ("no_gather", (10,), ["--gather-us", "0"]),
)
ROUNDS = 3  # interleaved: the VM drifts 10-20% over minutes, more than the modes differ


def median_rows(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure of each latency's row, the median over the rounds; the ratios of every round
    beside them (`rounds`)."""
    out: dict[str, Any] = {}
    for latency, first in rounds[0].items():
        row = {k: round(statistics.median(r[latency][k] for r in rounds), 3) for k in first}
        row["rounds"] = [
            {k: v for k, v in r[latency].items() if k.endswith("_over_1")} for r in rounds
        ]
        out[latency] = row
    return out


def aggregates_by_threads(
    model: Path, descriptor: list[str], workers: list[WorkerProcess]
) -> dict[str, Any]:
    """The aggregate rows at 2 threads per worker (`workers` as they ship) and at 1, on workers
    as they ship (`gather`), that always keep the convoy, and (at 10 ms) that never gather one:
    every set started at once and timed in ROUNDS interleaved rounds, the median kept."""
    out: dict[str, Any] = {}
    for threads in (THREADS, 1):
        compute_s = compute_per_token(model, threads)
        print(f"{threads} thread(s) per worker: {compute_s * 1000:.2f} ms/token", flush=True)
        row: dict[str, Any] = {"compute_ms_per_token": round(compute_s * 1000, 2)}
        own: list[WorkerProcess] = []
        try:
            sets: dict[str, list[WorkerProcess]] = {}
            for mode, _, extra in MODES:
                if threads == THREADS and mode == "gather":
                    sets[mode] = workers
                else:
                    sets[mode] = route_workers(model, descriptor, threads, extra)
                    own += sets[mode]
            rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode, _, _ in MODES}
            for k in range(ROUNDS):
                for mode, latencies, _ in MODES:
                    print(f"  round {k + 1}/{ROUNDS}, {mode.replace('_', ' ')}:", flush=True)
                    rounds[mode].append(aggregates(sets[mode], compute_s, latencies))
            for mode, results in rounds.items():
                row[mode] = median_rows(results)
        finally:
            for w in own:
                w.stop()
        out[f"{threads}_threads"] = row
    return out


def health_queued(addresses: list[str]) -> dict[str, float]:
    """/health latency while QUEUED requests wait for admission behind max_active 4."""
    route = Route.open(addresses, timeout=600, prefix_reuse=False)
    try:
        with serving(route, max_active=4, max_queue=QUEUED) as base:
            url = urlparse(base)
            body = {"model": "bench", "max_tokens": 8, "temperature": 0}
            clients = [
                threading.Thread(
                    target=lambda k=k: post_stream(
                        base,
                        {**body, "messages": [{"role": "user", "content": f"Count to {k + 9}."}]},
                    ),
                    daemon=True,
                )
                for k in range(QUEUED + 4)
            ]
            for c in clients:
                c.start()
            waiting, deadline = 0, time.monotonic() + 60
            while waiting < QUEUED and time.monotonic() < deadline:
                conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=30)
                conn.request("GET", "/health")
                waiting = json.loads(conn.getresponse().read()).get("waiting", 0)
                conn.close()
                time.sleep(0.05)
            times = []
            for _ in range(100):
                conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=30)
                t0 = time.perf_counter()
                conn.request("GET", "/health")
                conn.getresponse().read()
                times.append(time.perf_counter() - t0)
                conn.close()
                time.sleep(0.01)
            times.sort()
            for c in clients:  # the queue drains before the route closes
                c.join(600)
            return {
                "waiting_when_measured": waiting,
                "health_p50_ms": round(1000 * statistics.median(times), 1),
                "health_p99_ms": round(1000 * times[98], 1),
            }
    finally:
        route.close()


def check(gate: dict[str, float]) -> list[str]:
    missed = []
    for name, (op, bound) in THRESHOLDS.items():
        value = gate[name]
        ok = value <= bound if op == "<=" else value >= bound if op == ">=" else value < bound
        if not ok:
            missed.append(f"{name} {value} (wants {op} {bound})")
    return missed


def main(argv: list[str] | None = None) -> int:
    from dgr_artifacts.models import model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-q4_1")
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=("chat", "llama-server", "aggregate", "health")
    )
    args = parser.parse_args(argv)
    model = model_path(args.model)
    from dgr_route.tokenizer import Tokenizer

    TOKENIZER[:] = [Tokenizer(model)]
    descriptor = descriptor_args(model)
    workers = route_workers(model, descriptor, THREADS)
    result: dict[str, Any] = {
        "model": args.model,
        "layout": LAYOUT,
        "threads_per_worker": THREADS,
        "cores": os.cpu_count(),
        "thresholds": {k: f"{op} {b}" for k, (op, b) in THRESHOLDS.items()},
    }
    gate: dict[str, float] = {}
    try:
        addresses = [w.address for w in workers]
        if "chat" not in args.skip:
            conv = chats(addresses)
            reuse, full = conv["reuse"], conv["full"]
            result["chat"] = {
                name: [{k: v for k, v in r.items() if k != "text"} for r in rows]
                for name, rows in conv.items()
            }
            gate["ttft_turn8_over_turn1"] = round(reuse[-1]["ttft_ms"] / reuse[0]["ttft_ms"], 3)
            gate["ttft_turn8_over_turn1_full_prefill"] = round(
                full[-1]["ttft_ms"] / full[0]["ttft_ms"], 3
            )
            gate["cached_tokens_turn8"] = reuse[-1]["cached_tokens"]
            before = reuse[-2]["prompt_tokens"] + REPLY_TOKENS - 1
            if reuse[-1]["cached_tokens"] < min(before, reuse[-2]["prompt_tokens"]):
                raise AssertionError(
                    f"turn 8 reused {reuse[-1]['cached_tokens']} tokens, "
                    f"fewer than turn 7's prompt ({reuse[-2]['prompt_tokens']})"
                )
        if "llama-server" not in args.skip:
            reference = llama_server_chat(model)
            result.setdefault("chat", {})["llama_server"] = [
                {k: v for k, v in r.items() if k != "text"} for r in reference
            ]
            gate["llama_server_ttft_turn8_over_turn1"] = round(
                reference[-1]["ttft_ms"] / reference[0]["ttft_ms"], 3
            )
            gate["llama_server_cached_tokens_turn8"] = reference[-1]["cached_tokens"]
            if "chat" not in args.skip:
                # the same model, template and prompt tokens; the greedy texts are recorded,
                # not gated (two programs' kernels and samplers may part on a near tie): the
                # first turn whose reply differs, None where none does
                parted = [
                    i
                    for i, (a, b) in enumerate(zip(reference, conv["reuse"], strict=True), 1)
                    if a["text"] != b["text"]
                ]
                result["llama_server_first_differing_turn"] = parted[0] if parted else None
        if "aggregate" not in args.skip:
            by_threads = aggregates_by_threads(model, descriptor, workers)
            result["aggregate_by_threads"] = by_threads
            for threads, row in by_threads.items():
                suffix = "" if threads == f"{THREADS}_threads" else f"_{threads.split('_')[0]}t"
                agg = row["gather"]
                for latency in LATENCIES_MS:
                    for n in SESSIONS[1:]:
                        key = f"aggregate_{n}_over_1_at_{latency}ms{suffix}"
                        gate[key] = agg[f"{latency}ms"][f"{n}_over_1"]
                # what this host's cores allow: K sessions with no latency at all, over one
                # session behind the links (the links can only take away from what compute gives)
                for n in SESSIONS[1:]:
                    ceiling = agg["0ms"][f"{n}_sessions_tps"] / agg["10ms"]["1_sessions_tps"]
                    gate[f"ceiling_{n}_over_1_at_10ms{suffix}"] = round(ceiling, 3)
                    loose = row["no_gather"]["10ms"][f"{n}_over_1"]
                    gate[f"aggregate_{n}_over_1_at_10ms_no_gather{suffix}"] = loose
                    for latency in LATENCIES_MS:
                        always = row["convoy_always"][f"{latency}ms"][f"{n}_over_1"]
                        gate[f"aggregate_{n}_over_1_at_{latency}ms_convoy_always{suffix}"] = always
        if "health" not in args.skip:
            result["health"] = health_queued(addresses)
            gate["health_p99_ms_64_queued"] = result["health"]["health_p99_ms"]
            print(f"health with {QUEUED} queued: {result['health']}", flush=True)
    finally:
        for w in workers:
            w.stop()
    missed = check(gate) if len(gate) >= len(THRESHOLDS) else []
    result["gate_metrics"] = gate
    result["missed"] = missed
    path = write_bench("bench-serve", result)
    report("bench_serve", gate)
    print(json.dumps(gate, indent=2))
    print(f"wrote {path}" + (f"; missed: {'; '.join(missed)}" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
