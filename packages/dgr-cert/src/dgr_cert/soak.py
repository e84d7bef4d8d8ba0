"""`nox -s soak` (DGR-064): concurrent sessions for a while, with bounded memory and no leaks.

Real workers serve a 3-stage SmolLM2 route; load comes from sessions driven through the
coordinator (random prompts, lengths and sampling) and from HTTP clients of the OpenAI server
(`dgr serve`, a process of its own, streaming and not). Every 2 s each worker's RSS, open file
descriptors, threads and Health sessions are sampled, and the server's RSS.

Checks, after the warm-up: each worker's RSS grows less than 2% (median of the last tenth of the
samples against the first tenth after warm-up); no request fails; once the load stops, every
stage holds no session, its file descriptors are back to their count before the load, and its
threads are back to idle: the ones the worker starts itself as many as before, gRPC's pools
within a small slack. Under load, threads and descriptors follow the streams open at the moment
(a handler and a connection per stream): their peaks are reported. Writes
evidence/soak/soak.json (samples included), which the evidence site plots as RSS over time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from dgr_cli.workers import descriptor_args, start_worker
from dgr_prd.paths import find_root
from dgr_records import report
from dgr_route.route import Route, Sampling
from dgr_route.session import RouteSession

LAYOUT = [(0, 10), (10, 20), (20, 30)]
RSS_GROWTH_MAX = 0.02
SAMPLE_S = 2.0


def proc_stats(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss_kib": int(fields["VmRSS"].split()[0]),
        "threads": int(fields["Threads"]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


# gRPC's own pools (executor, event engine, sync-server pollers) may keep a few more idle
# threads after a load than before it; they are bounded by gRPC, not by the load's length
GRPC_IDLE_SLACK = 4
FD_IDLE_SLACK = 2  # an epoll or eventfd gRPC may keep for a pool thread it kept


def idle_thread_problems(
    before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]
) -> list[str]:
    """Once the load has stopped and every session is freed, the threads a worker starts itself
    (named after the process: sessions' link readers, the head's upstream readers) are back to
    their count before the load, and the rest within gRPC's idle slack."""
    problems = []
    for name in before:
        if not name.startswith("worker"):
            continue
        own = "dgr-shard-worke"
        if after[name].get(own, 0) > before[name].get(own, 0):
            problems.append(
                f"{name}: {after[name].get(own, 0)} own threads after the load, "
                f"{before[name].get(own, 0)} before"
            )
        if sum(after[name].values()) > sum(before[name].values()) + GRPC_IDLE_SLACK:
            problems.append(
                f"{name}: {sum(after[name].values())} threads idle after the load, "
                f"{sum(before[name].values())} before"
            )
    return problems


def thread_names(pid: int) -> dict[str, int]:
    """A process's threads counted by name (gRPC's pools, ggml's, the worker's own)."""
    names: dict[str, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        names[name] = names.get(name, 0) + 1
    return dict(sorted(names.items()))


class Load:
    def __init__(self, route: Route, http: str, seed: int) -> None:
        self.route = route
        self.http = http
        self.seed = seed
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.tokens = 0
        self.requests = 0
        self.lock = threading.Lock()

    def _count(self, tokens: int) -> None:
        with self.lock:
            self.tokens += tokens
            self.requests += 1

    def route_sessions(self, k: int) -> None:
        rng = random.Random(self.seed * 100 + k)
        while not self.stop.is_set():
            prompt = [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 200))]
            sampling = (
                Sampling()
                if rng.random() < 0.5
                else Sampling(
                    temperature=rng.uniform(0.2, 1.2),
                    top_k=rng.choice([0, 20, 40]),
                    top_p=rng.choice([0.0, 0.9, 0.95]),
                    seed=rng.randrange(1 << 30),
                )
            )
            try:
                session = RouteSession(self.route, sampling)
                got = list(session.generate(prompt, rng.randrange(1, 64)))
                self._count(len(got))
            except Exception as exc:  # every failure is a finding
                self.errors.append(f"route session: {exc}")

    def http_clients(self, k: int) -> None:
        rng = random.Random(self.seed * 1000 + k)
        words = [
            "the",
            "a",
            "of",
            "to",
            "and",
            "in",
            "is",
            "it",
            "you",
            "that",
            "he",
            "was",
            "for",
            "on",
            "are",
            "with",
            "as",
            "I",
            "his",
            "they",
        ]
        while not self.stop.is_set():
            stream = rng.random() < 0.5
            body = {
                "model": "smollm2",
                "prompt": " ".join(rng.choice(words) for _ in range(rng.randrange(1, 60))),
                "max_tokens": rng.randrange(1, 48),
                "temperature": rng.choice([0.0, 0.7, 1.0]),
                "stream": stream,
            }
            request = urllib.request.Request(
                f"{self.http}/v1/completions",
                data=json.dumps(body).encode(),
                headers={"content-type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=120) as reply:
                    data = reply.read().decode()
                    if reply.status != 200:
                        raise RuntimeError(f"HTTP {reply.status}")
                if stream and not data.rstrip().endswith("data: [DONE]"):
                    raise RuntimeError("a stream without its [DONE]")
                self._count(0)
            except Exception as exc:
                self.errors.append(f"http: {exc}")


def start_server(route: list[str], model: Path) -> tuple[subprocess.Popen[str], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, dgr_cli; sys.exit(dgr_cli.main())",
            "serve",
            "--route",
            ",".join(route),
            "--model",
            str(model),
            "--model-name",
            "smollm2",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dgr serve exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            urllib.request.urlopen(f"{url}/v1/models", timeout=2).read()
            return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("dgr serve did not come up in 120 s")


def analyze(samples: list[dict[str, Any]], warmup_s: float, names: list[str]) -> dict[str, Any]:
    after = [s for s in samples if s["t"] >= warmup_s]
    out: dict[str, Any] = {"samples_after_warmup": len(after), "processes": {}}
    if len(after) < 8:
        out["problems"] = ["too few samples after the warm-up"]
        return out
    tenth, quarter = max(1, len(after) // 10), max(1, len(after) // 4)
    problems = []
    for name in names:
        rss = [s[name]["rss_kib"] for s in after]
        growth = statistics.median(rss[-tenth:]) / statistics.median(rss[:tenth]) - 1
        fds_first, fds_last = (
            max(s[name]["fds"] for s in part) for part in (after[:quarter], after[-quarter:])
        )
        thr_first, thr_last = (
            max(s[name]["threads"] for s in part) for part in (after[:quarter], after[-quarter:])
        )
        out["processes"][name] = {
            "rss_mib_start": round(statistics.median(rss[:tenth]) / 1024, 2),
            "rss_mib_end": round(statistics.median(rss[-tenth:]) / 1024, 2),
            "rss_growth": round(growth, 5),
            "fds_peak_first_quarter": fds_first,
            "fds_peak_last_quarter": fds_last,
            "threads_peak_first_quarter": thr_first,
            "threads_peak_last_quarter": thr_last,
        }
        if name.startswith("worker") and growth >= RSS_GROWTH_MAX:
            problems.append(f"{name}: RSS grew {growth:.2%} after the warm-up")

    out["problems"] = problems
    return out


def run(seconds: float, warmup_s: float, sessions: int, http: int, seed: int) -> dict[str, Any]:
    from dgr_artifacts.models import model_path

    model = model_path("smollm2-135m-q4_1")
    descriptor = descriptor_args(model)
    workers = [
        start_worker(
            model,
            a,
            b,
            descriptor=descriptor,
            threads=1,
            n_ctx=1024,
            max_sessions=sessions + http + 2,
        )
        for a, b in LAYOUT
    ]
    server = None
    try:
        addresses = [w.address for w in workers]
        server, url = start_server(addresses, model)
        route = Route.open(addresses, timeout=60)
        load = Load(route, url, seed)
        pool = [threading.Thread(target=load.route_sessions, args=(k,)) for k in range(sessions)]
        pool += [threading.Thread(target=load.http_clients, args=(k,)) for k in range(http)]
        names = [f"worker{i}" for i in range(len(workers))] + ["server"]
        pids = [w.proc.pid for w in workers] + [server.pid]
        idle_before = {name: thread_names(pid) for name, pid in zip(names, pids, strict=True)}
        fds_before = {name: proc_stats(pid)["fds"] for name, pid in zip(names, pids, strict=True)}
        samples: list[dict[str, Any]] = []
        t0 = time.monotonic()
        for t in pool:
            t.start()
        while (now := time.monotonic() - t0) < seconds:
            sample: dict[str, Any] = {"t": round(now, 2), "tokens": load.tokens}
            for name, pid in zip(names, pids, strict=True):
                sample[name] = proc_stats(pid)
            sample["sessions"] = [w.sessions() for w in workers]
            samples.append(sample)
            time.sleep(SAMPLE_S)
        load.stop.set()
        for t in pool:
            t.join(180)
        hung = sum(t.is_alive() for t in pool)
        deadline = time.monotonic() + 15
        while any(w.sessions() for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [w.sessions() for w in workers]
        idle_threads = {name: thread_names(pid) for name, pid in zip(names, pids, strict=True)}
        fds_after = {name: proc_stats(pid)["fds"] for name, pid in zip(names, pids, strict=True)}
        route.close()
        verdict = analyze(samples, warmup_s, names)
        problems = list(verdict.pop("problems"))
        if load.errors:
            problems.append(f"{len(load.errors)} failed requests, first: {load.errors[0]}")
        if hung:
            problems.append(f"{hung} load threads did not finish")
        if any(left):
            problems.append(f"sessions left after the load: {left}")
        problems += idle_thread_problems(idle_before, idle_threads)
        problems += [
            f"{name}: {fds_after[name]} file descriptors idle after the load, "
            f"{fds_before[name]} before"
            for name in names
            if fds_after[name] > fds_before[name] + FD_IDLE_SLACK
        ]
        return {
            "seconds": seconds,
            "warmup_s": warmup_s,
            "route_sessions": sessions,
            "http_clients": http,
            "seed": seed,
            "requests": load.requests,
            "tokens_generated": load.tokens,
            "errors": len(load.errors),
            "error_examples": load.errors[:5],
            "sessions_left": left,
            "fds_before_load": fds_before,
            "fds_after_load": fds_after,
            "threads_by_name_before_load": idle_before,
            "threads_by_name_after_load": idle_threads,
            "rss_growth_max": RSS_GROWTH_MAX,
            **verdict,
            "problems": problems,
            "samples": samples,
        }
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
        for w in workers:
            w.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dgr_cert.soak")
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument(
        "--warmup", type=float, help="seconds before the bounds apply (default: a fifth)"
    )
    parser.add_argument("--sessions", type=int, default=3, help="coordinator sessions at once")
    parser.add_argument("--http", type=int, default=2, help="OpenAI-server clients at once")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--out", default="evidence/soak/soak.json")
    args = parser.parse_args(argv)
    warmup = args.warmup if args.warmup is not None else args.seconds / 5
    result = run(args.seconds, warmup, args.sessions, args.http, args.seed)
    result["measured_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = Path(args.out) if Path(args.out).is_absolute() else find_root().root / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=1))
    metrics: dict[str, float] = {
        "requests": result["requests"],
        "errors": result["errors"],
        "tokens_generated": result["tokens_generated"],
    }
    for name, p in result.get("processes", {}).items():
        metrics[f"{name}_rss_growth"] = p["rss_growth"]
    report("soak", metrics)
    return 0 if not result["problems"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
