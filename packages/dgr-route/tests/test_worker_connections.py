"""What a connection costs a worker before it is served (native/worker/datalink.cpp, Listener).
Raw sockets open connections to a real worker that send nothing, part of the data magic, part
of a HELLO, a HELLO larger than a connection may send before authentication, or bytes that are
neither a data stream nor HTTP/2, and then close or stall. None of them may cost a thread: they
wait in the listener's one event loop until they are classified, and a connection that closes
part-way or stalls past the HELLO deadline is closed. After each kind the worker's thread count
and RSS are back at idle within 2 s, and the worker still serves a route.

Before the event loop, each such connection had a thread of its own; one that sent "DG" and then
closed kept it for good (the thread re-peeked the same two bytes forever)."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from dgr.v1 import shard_pb2 as pb
from dgr_cli.workers import WorkerProcess, start_worker
from dgr_route.route import Route
from dgr_route.security import Security

TOKEN = "conn-s3cret"
HOLD = 100  # connections of each kind, held at once
HELLO_TIMEOUT_S = 5.0  # ListenerLimits::hello_timeout
RSS_SLACK_KIB = 8 << 10


def frame(kind: int, payload: bytes = b"") -> bytes:
    return struct.pack("<IB", len(payload), kind) + payload


def hello(token: str) -> bytes:
    message = pb.DataHello(stream=pb.DATA_STREAM_FORWARD, token=token)
    return b"DGR1" + frame(pb.DATA_FRAME_HELLO, message.SerializeToString())


# what a connection sends before it closes or stalls: none of it is enough to be served
OPENINGS = {
    "nothing": b"",
    "one byte of the magic": b"D",
    "part of the magic": b"DG",
    "part of a HELLO header": b"DGR1" + b"\x10\x00",
    "part of a HELLO payload": b"DGR1" + struct.pack("<IB", 200, pb.DATA_FRAME_HELLO) + b"x" * 50,
    "a HELLO over 4 KiB": b"DGR1" + struct.pack("<IB", 5000, pb.DATA_FRAME_HELLO) + b"x" * 100,
    "a REQUEST before its HELLO": b"DGR1" + frame(pb.DATA_FRAME_REQUEST, b"x"),
    "part of HTTP/2's preface": b"PRI * HTTP",
    "neither protocol": b"GET / HTTP/1.1\r\n\r\n",
}


def threads(worker: WorkerProcess) -> int:
    return len(os.listdir(f"/proc/{worker.proc.pid}/task"))


def rss_kib(worker: WorkerProcess) -> int:
    for line in Path(f"/proc/{worker.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def settle(worker: WorkerProcess, idle_threads: int, within: float = 2.0) -> float:
    """Seconds until the worker's thread count is back at idle (or `within`, whichever first)."""
    start = time.monotonic()
    while time.monotonic() - start < within and threads(worker) > idle_threads:
        time.sleep(0.02)
    return time.monotonic() - start


def connect(worker: WorkerProcess) -> socket.socket:
    host, port = worker.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


@pytest.fixture(scope="module")
def worker(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    token = tmp_path_factory.mktemp("token") / "token"
    token.write_text(TOKEN + "\n")
    w = start_worker(smollm2, 0, 30, threads=1, n_ctx=256, extra=["--auth-token-file", str(token)])
    yield w
    w.stop()


def generates(worker: WorkerProcess) -> list[int]:
    route = Route.open([worker.address], timeout=10, security=Security(token=TOKEN))
    try:
        return list(route.generate([1, 2, 3, 4], 4))
    finally:
        route.close()


def idle(worker: WorkerProcess) -> tuple[int, int]:
    time.sleep(0.3)  # whatever the last test left has ended
    return threads(worker), rss_kib(worker)


@pytest.mark.parametrize("opening", list(OPENINGS))
def test_connections_that_close_part_way_cost_nothing(worker: WorkerProcess, opening: str) -> None:
    idle_threads, idle_rss = idle(worker)
    socks = []
    for _ in range(HOLD):
        s = connect(worker)
        s.sendall(OPENINGS[opening])
        socks.append(s)
    time.sleep(0.2)
    held = threads(worker)
    for s in socks:
        s.close()
    waited = settle(worker, idle_threads)
    assert held <= idle_threads, f"{HOLD} held connections ({opening}) took threads"
    assert threads(worker) <= idle_threads, f"threads above idle {waited:.2f} s after the close"
    assert rss_kib(worker) <= idle_rss + RSS_SLACK_KIB
    assert generates(worker)  # and it serves on


def test_a_stalled_connection_is_closed_at_the_hello_deadline(worker: WorkerProcess) -> None:
    """Connections that send part of an opening and then wait are closed by the worker once
    the HELLO deadline has passed, never served, and never given a thread meanwhile."""
    idle_threads, _ = idle(worker)
    socks = [connect(worker) for _ in range(HOLD)]
    for i, s in enumerate(socks):
        s.sendall(list(OPENINGS.values())[i % len(OPENINGS)])
    start = time.monotonic()
    closed_after = []
    for s in socks:
        s.settimeout(HELLO_TIMEOUT_S * 2)
        # closed without a byte of reply; with its peeked bytes unread, by a reset
        with contextlib.suppress(ConnectionResetError):
            assert s.recv(64) == b""
        closed_after.append(time.monotonic() - start)
        assert threads(worker) <= idle_threads
        s.close()
    assert HELLO_TIMEOUT_S - 0.5 <= closed_after[0] <= HELLO_TIMEOUT_S + 1.5
    assert max(closed_after) <= HELLO_TIMEOUT_S + 1.5


def test_a_whole_hello_is_served_and_authenticated(worker: WorkerProcess) -> None:
    """The control: the same port serves a stream whose HELLO arrived whole (here with a wrong
    token, refused by name), so the checks above measure refusals, not a dead listener."""
    with connect(worker) as s:
        s.sendall(hello("not-the-token"))
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
    n, kind = struct.unpack("<IB", data[:5])
    assert kind == pb.DATA_FRAME_END
    end = pb.DataEnd.FromString(data[5 : 5 + n])
    assert end.message == "wrong bearer token"


def test_data_streams_past_the_cap_are_refused_by_name(smollm2: Path, tmp_path: Path) -> None:
    """--max-data-streams 1: while one stream is served (a stage waiting for its first
    request), the next is refused with RESOURCE_EXHAUSTED naming the flag; once the first has
    gone, a stream is served again."""
    w = start_worker(smollm2, 10, 20, threads=1, n_ctx=256, extra=["--max-data-streams", "1"])
    try:
        first = connect(w)
        first.sendall(hello(""))
        time.sleep(0.3)
        with connect(w) as second:
            second.sendall(hello(""))
            second.settimeout(5)
            data = second.recv(1 << 16)
        n, kind = struct.unpack("<IB", data[:5])
        end = pb.DataEnd.FromString(data[5 : 5 + n])
        assert kind == pb.DATA_FRAME_END and end.code == 8  # RESOURCE_EXHAUSTED
        assert "--max-data-streams" in end.message
        first.close()
        time.sleep(0.5)
        with connect(w) as third:
            third.sendall(hello("") + frame(pb.DATA_FRAME_REQUEST, b"\xff"))
            third.shutdown(socket.SHUT_WR)
            third.settimeout(5)
            data = third.recv(1 << 16)
        n, kind = struct.unpack("<IB", data[:5])
        end = pb.DataEnd.FromString(data[5 : 5 + n])
        assert kind == pb.DATA_FRAME_END and end.code != 8  # served: refused for its request
    finally:
        w.stop()
