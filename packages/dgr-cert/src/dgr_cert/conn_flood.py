"""10,000 unauthenticated connections against a worker while a route generates (`nox -s
conn-flood`): what the worker's pre-authentication event loop must hold (native/worker
datalink.cpp, Listener).

A 3-stage SmolLM2 route of plaintext workers that need a bearer token generates once
undisturbed, then again while a thread of this process keeps `--connections` connections open
to the middle stage (re-opening any the worker closed), each sending some prefix of an opening
that is never enough to be served: nothing, part of the data magic, part of a HELLO, part of
HTTP/2's preface. Every 50 ms the middle stage's threads, RSS and open descriptors are sampled.
It passes when the disturbed generation's tokens equal the undisturbed one's, an authenticated
client's call succeeds during the flood, and the middle stage's threads stay at most idle + 2
and its RSS within 64 MiB of idle. The figures go to evidence/bench/conn-flood.json."""

from __future__ import annotations

import argparse
import os
import resource
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

from dgr_artifacts.models import model_path
from dgr_cli.workers import WorkerProcess, start_stages
from dgr_records import report, write_bench
from dgr_route.route import Route
from dgr_route.security import Security

TOKEN = "flood-s3cret"
LAYOUT = [(0, 10), (10, 20), (20, 30)]
OPENINGS = [
    b"",
    b"D",
    b"DG",
    b"DGR1\x10",
    b"DGR1" + struct.pack("<IB", 300, 1) + b"x" * 20,
    b"PRI * ",
]
THREAD_SLACK = 2
RSS_SLACK_MIB = 64


def proc_figures(pid: int) -> tuple[int, int, int]:
    """Threads, RSS (KiB) and open descriptors of a process."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
    return len(os.listdir(f"/proc/{pid}/task")), rss, len(os.listdir(f"/proc/{pid}/fd"))


class Flood:
    """Keeps `count` unauthenticated connections open to `address` until stopped."""

    def __init__(self, address: str, count: int) -> None:
        host, port = address.rsplit(":", 1)
        self.target = (host, int(port))
        self.count = count
        self.opened = self.refused = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        socks: list[socket.socket] = []
        while not self.stop.is_set():
            while len(socks) < self.count and not self.stop.is_set():
                try:
                    s = socket.create_connection(self.target, timeout=2)
                    s.setblocking(False)
                    s.send(OPENINGS[self.opened % len(OPENINGS)])
                    socks.append(s)
                    self.opened += 1
                except OSError:
                    self.refused += 1
                    break
            kept = []
            for s in socks:  # the ones the worker closed go, and are opened again
                try:
                    closed = s.recv(16) == b""
                except BlockingIOError:
                    closed = False
                except OSError:
                    closed = True
                if closed:
                    s.close()
                else:
                    kept.append(s)
            socks = kept
            time.sleep(0.05)
        for s in socks:
            s.close()


def generate(addresses: list[str], prompt: list[int], n: int) -> list[int]:
    route = Route.open(addresses, timeout=60, security=Security(token=TOKEN))
    try:
        return list(route.generate(prompt, n))
    finally:
        route.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dgr-cert conn-flood", description=__doc__)
    ap.add_argument("--connections", type=int, default=10_000)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1, help="compute threads per worker")
    args = ap.parse_args(argv)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, args.connections + 1024), hard))

    token = Path(os.environ.get("TMPDIR", "/tmp")) / f"dgr-flood-token-{os.getpid()}"
    token.write_text(TOKEN + "\n")
    workers: list[WorkerProcess] = start_stages(
        model_path(),
        LAYOUT,
        threads=args.threads,
        n_ctx=1024,
        extra=["--auth-token-file", str(token)],
    )
    try:
        addresses = [w.address for w in workers]
        middle = workers[1]
        prompt = list(range(1000, 1300))  # 300 tokens
        started = time.monotonic()
        undisturbed = generate(addresses, prompt, args.tokens)
        quiet_seconds = time.monotonic() - started
        time.sleep(0.5)
        idle_threads, idle_rss, idle_fds = proc_figures(middle.proc.pid)

        flood = Flood(middle.address, args.connections)
        samples: list[tuple[int, int, int]] = []
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.is_set():
                samples.append(proc_figures(middle.proc.pid))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        flood.thread.start()
        sampler.start()
        while flood.opened < args.connections and flood.thread.is_alive():
            time.sleep(0.1)
        opened_before_route = flood.opened
        started = time.monotonic()
        disturbed = generate(addresses, prompt, args.tokens)
        seconds = time.monotonic() - started
        authenticated = middle.sessions(token=TOKEN) == 0  # a Health call with the token
        flood.stop.set()
        flood.thread.join(30)
        sampling.set()
        sampler.join(5)
        time.sleep(1.0)
        after_threads, after_rss, after_fds = proc_figures(middle.proc.pid)
    finally:
        for w in workers:
            w.stop()
        token.unlink(missing_ok=True)

    max_threads = max(t for t, _, _ in samples)
    max_rss = max(r for _, r, _ in samples)
    checks = {
        "tokens_equal_undisturbed": disturbed == undisturbed,
        "authenticated_client_served": authenticated,
        "threads_bounded": max_threads <= idle_threads + THREAD_SLACK,
        "rss_bounded": max_rss <= idle_rss + RSS_SLACK_MIB * 1024,
        "threads_back_at_idle": after_threads <= idle_threads,
    }
    result: dict[str, Any] = {
        "connections_held": args.connections,
        "connections_opened": flood.opened,
        "opened_before_route": opened_before_route,
        "connect_failures": flood.refused,
        "tokens": args.tokens,
        "prompt_tokens": len(prompt),
        "threads_per_worker": args.threads,
        "route_seconds_undisturbed": round(quiet_seconds, 3),
        "route_seconds_under_flood": round(seconds, 3),
        # the worker holds at most 1,024 unclassified connections and closes the oldest past
        # that (and any at its 5 s HELLO deadline); the flood opens each closed one again
        "note": "connections_opened counts re-opens of those the worker closed",
        "middle_stage": {
            "idle": {"threads": idle_threads, "rss_kib": idle_rss, "fds": idle_fds},
            "max_under_flood": {
                "threads": max_threads,
                "rss_kib": max_rss,
                "fds": max(f for _, _, f in samples),
            },
            "after": {"threads": after_threads, "rss_kib": after_rss, "fds": after_fds},
            "samples": len(samples),
        },
        "bounds": {"threads_over_idle": THREAD_SLACK, "rss_over_idle_mib": RSS_SLACK_MIB},
        "checks": checks,
        "passed": all(checks.values()),
        "cores": os.cpu_count(),
    }
    path = write_bench("conn-flood", result)
    report("conn_flood", result)
    print(
        f"conn-flood: {flood.opened} connections opened, middle stage threads "
        f"{idle_threads} idle / {max_threads} max, RSS {idle_rss} / {max_rss} KiB; {checks}"
    )
    print(f"wrote {path}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
