"""Start and stop real dgr-shard-worker processes (the C++ binary built with the engine)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dgr_wire.ranges import LayerRange

READY = "DGR-WORKER-READY port="
METRICS = "DGR-WORKER-METRICS port="  # printed before READY when --metrics-listen is given


class WorkerStartError(RuntimeError):
    pass


@dataclass
class WorkerProcess:
    proc: subprocess.Popen[str]
    host: str
    port: int
    layers: LayerRange
    log: list[str] = field(default_factory=list)

    @property
    def metrics_url(self) -> str | None:
        """Where its /metrics and /metrics.json are served (with --metrics-listen), else None."""
        for line in self.log:
            if line.startswith(METRICS):
                return f"http://{self.host}:{int(line[len(METRICS) :])}"
        return None

    def metrics_json(self, timeout: float = 10.0) -> dict[str, Any]:
        """Its /metrics.json now: every figure by name (it runs with --metrics-listen)."""
        import json
        import urllib.request

        if self.metrics_url is None:
            raise RuntimeError(f"worker {self.address} serves no metrics (no --metrics-listen)")
        with urllib.request.urlopen(self.metrics_url + "/metrics.json", timeout=timeout) as r:
            data: dict[str, Any] = json.load(r)
        return data

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM (drain), then SIGKILL if it does not exit in time; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def sessions(self, timeout: float = 5.0, token: str | None = None) -> int:
        """The sessions the worker holds now (its Health answer; a channel of its own, closed;
        `token`: the worker's bearer token, where it needs one)."""
        import grpc
        from dgr.v1 import shard_pb2 as pb
        from dgr.v1 import shard_pb2_grpc as pb_grpc

        metadata = [("authorization", f"Bearer {token}")] if token else None
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.ShardServiceStub(channel)  # type: ignore[no-untyped-call]  # generated
            return int(stub.Health(pb.HealthRequest(), timeout=timeout, metadata=metadata).sessions)


def descriptor_args(model: Path) -> list[str]:
    """The model's fingerprint, which a worker reports beside the build identity compiled into
    it (llama.cpp commit, patch stack, lane): nothing here depends on a checkout. Hashed once per
    version of the model's files on this machine (`stored_fingerprint`)."""
    from dgr_artifacts.identity import stored_fingerprint

    return ["--model-fingerprint", stored_fingerprint(model)]


def start_worker(
    model: Path,
    first: int,
    last: int,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    threads: int = 2,
    n_ctx: int = 2048,
    n_batch: int = 512,
    max_sessions: int = 4,
    extra: list[str] | None = None,
    descriptor: list[str] | None = None,
    timeout: float = 120.0,
    cwd: Path | None = None,
    lane: str = "cpu",
) -> WorkerProcess:
    from dgr_route.engine import locate

    if os.environ.get("DGR_NO_WORKERS"):  # the fast test tier (./dev check) starts none
        raise RuntimeError(
            "DGR_NO_WORKERS is set: this starts a worker process (a test that does is marked "
            "`fleet`, which ./dev check leaves out; see packages/conftest.py)"
        )
    cmd = [
        str(locate(lane).worker),
        "--model",
        str(model),
        "--layers",
        f"{first}:{last}",
        "--listen",
        f"{host}:{port}",
        "--threads",
        str(threads),
        "--n-ctx",
        str(n_ctx),
        "--n-batch",
        str(n_batch),
        "--max-sessions",
        str(max_sessions),
        *(descriptor if descriptor is not None else descriptor_args(model)),
        *(extra or []),
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "GRPC_VERBOSITY": "ERROR"},
        cwd=cwd,
    )
    assert proc.stdout is not None
    log: list[str] = []
    # raw reads of the pipe: a buffered readline() can take several lines at once (the metrics
    # port, then READY) and leave select() waiting on a pipe that has nothing more to say
    fd, pending = proc.stdout.fileno(), b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace").rstrip()
                log.append(line)
                if line.startswith(READY):
                    if pending:
                        log.append(pending.decode(errors="replace"))
                    return WorkerProcess(
                        proc,
                        host,
                        int(line[len(READY) :].strip()),
                        LayerRange(first=first, last=last),
                        log,
                    )
        elif proc.poll() is not None:
            break
    proc.kill()
    tail = "\n".join(log[-20:])
    raise WorkerStartError(
        f"worker for layers [{first}, {last}) did not become ready (exit {proc.poll()}):\n{tail}"
    )


def start_stages(
    model: Path, layout: Sequence[tuple[int, int]], **options: Any
) -> list[WorkerProcess]:
    """A worker per (first, last) range of `layout`, in order, each with the model's descriptor
    (computed once) and `options` as start_worker takes them; if one fails to start, the ones
    already started are stopped before the error goes on."""
    options.setdefault("descriptor", descriptor_args(model))
    started: list[WorkerProcess] = []
    try:
        for first, last in layout:
            started.append(start_worker(model, first, last, **options))
    except BaseException:
        for w in started:
            w.stop()
        raise
    return started
