"""The direct data plane (native/worker/datalink.cpp) on real workers: forward mode's links
between plaintext workers are framed TCP streams on the worker's own port. Raw sockets speak
to the worker as a peer stage would (or as an attacker could): the worker refuses a stream
without the route's token, a malformed frame, a stream its role does not take, and a peer that
falls silent, each with a typed END naming what was wrong, and serves on afterwards. Routes
over data links and over gRPC links give the same tokens."""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from dgr.v1 import shard_pb2 as pb
from dgr.v1 import shard_pb2_grpc as pb_grpc
from dgr_cli.workers import WorkerProcess, descriptor_args, start_stages, start_worker
from dgr_route.route import Route, RouteError
from dgr_wire.codec import FNV_OFFSET

LAYOUT = [(0, 10), (10, 20), (20, 30)]
KEEPALIVE_MS = 600
TOKEN = "s3cret"


def frame(kind: int, payload: bytes = b"") -> bytes:
    return struct.pack("<IB", len(payload), kind) + payload


def hello(
    stream: int, token: str = "", version: int = 1, capabilities: tuple[str, ...] = ()
) -> bytes:
    message = pb.DataHello(
        stream=stream, token=token, version=version, capabilities=list(capabilities)
    )
    return b"DGR1" + frame(pb.DATA_FRAME_HELLO, message.SerializeToString())


def read_frames(sock: socket.socket, timeout: float = 10.0) -> list[tuple[int, bytes]]:
    """Every frame the worker sends until it closes the stream."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    frames = []
    while data:
        n, kind = struct.unpack("<IB", data[:5])
        frames.append((kind, data[5 : 5 + n]))
        data = data[5 + n :]
    return frames


def end_of(frames: list[tuple[int, bytes]]) -> pb.DataEnd:
    kind, payload = frames[-1]
    assert kind == pb.DATA_FRAME_END, frames
    return pb.DataEnd.FromString(payload)


def stream(worker: WorkerProcess, data: bytes, half_close: bool = True) -> list[tuple[int, bytes]]:
    host, port = worker.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        return read_frames(sock)


@pytest.fixture(scope="module")
def fleet(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerProcess]]:
    """A 3-stage route of workers that need a bearer token."""
    token = tmp_path_factory.mktemp("token") / "token"
    token.write_text(TOKEN + "\n")
    workers = start_stages(
        smollm2,
        LAYOUT,
        threads=1,
        n_ctx=512,
        extra=["--auth-token-file", str(token), "--keepalive-ms", str(KEEPALIVE_MS)],
    )
    yield workers
    for w in workers:
        w.stop()


def request(stage_index: int, addresses: list[str]) -> pb.ForwardRequest:
    return pb.ForwardRequest(
        session_id=7,
        expect=pb.CacheExpectation(epoch=1, prefix_hash=FNV_OFFSET),
        token_ids=[1, 2, 3],
        route=pb.RouteSpec(stages=addresses, stage_index=stage_index),
        last_chunk=True,
        max_tokens=1,
    )


def test_a_stream_without_the_token_is_refused(fleet: list[WorkerProcess]) -> None:
    for token, what in (("", "missing authorization"), ("guess", "wrong bearer token")):
        end = end_of(stream(fleet[1], hello(pb.DATA_STREAM_FORWARD, token)))
        assert end.code == grpc.StatusCode.UNAUTHENTICATED.value[0] and what in end.message
    assert fleet[1].sessions(token=TOKEN) == 0


def test_a_hello_of_another_version_or_capability_is_refused_naming_it(
    fleet: list[WorkerProcess],
) -> None:
    """The HELLO says which data-plane version the peer speaks and what its stream may carry: a
    version other than the worker's is refused naming both, a capability the worker lacks by
    name; version 0 (a HELLO from before the field) is version 1, and this build's own
    capabilities are served."""
    failed = grpc.StatusCode.FAILED_PRECONDITION.value[0]
    end = end_of(stream(fleet[1], hello(pb.DATA_STREAM_FORWARD, TOKEN, version=2)))
    assert end.code == failed, end
    assert "data-plane version 2, this worker version 1" in end.message, end
    end = end_of(stream(fleet[1], hello(pb.DATA_STREAM_FORWARD, TOKEN, capabilities=("teleport",))))
    assert end.code == failed and "capability 'teleport'" in end.message, end
    mine = ("cohorts", "draft-parts", "prefix-reuse", "mtp")
    for version in (0, 1):
        end = end_of(
            stream(fleet[1], hello(pb.DATA_STREAM_FORWARD, TOKEN, version, capabilities=mine))
        )
        assert end.code == 0, end  # served: no request came, the stream ended cleanly
    assert fleet[1].sessions(token=TOKEN) == 0


@pytest.mark.parametrize(
    "body,words",
    [
        (struct.pack("<IB", 1 << 30, pb.DATA_FRAME_REQUEST), "more than"),
        (struct.pack("<IB", 0, 77), "unknown frame kind 77"),
        (frame(pb.DATA_FRAME_REQUEST, b"\xff\xff\xff"), "does not parse as dgr.v1.ForwardRequest"),
        (frame(pb.DATA_FRAME_REPLY, b""), "a DATA_FRAME_REPLY frame where DATA_FRAME_REQUEST"),
        (frame(pb.DATA_FRAME_REQUEST, b"")[:3], "within a frame"),
    ],
)
def test_a_malformed_frame_ends_the_stream_naming_it(
    fleet: list[WorkerProcess], body: bytes, words: str
) -> None:
    frames = stream(fleet[1], hello(pb.DATA_STREAM_FORWARD, TOKEN) + body)
    end = end_of(frames)
    assert end.code in (
        grpc.StatusCode.INVALID_ARGUMENT.value[0],
        grpc.StatusCode.UNAVAILABLE.value[0],
    ), end
    assert words in end.message, end.message
    assert fleet[1].sessions(token=TOKEN) == 0


def test_roles_the_worker_does_not_take_are_refused(fleet: list[WorkerProcess]) -> None:
    addresses = [w.address for w in fleet]
    data = frame(pb.DATA_FRAME_REQUEST, request(0, addresses).SerializeToString())
    end = end_of(stream(fleet[0], hello(pb.DATA_STREAM_FORWARD, TOKEN) + data))
    assert end.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "the head takes its stream from the coordinator" in end.message
    token = pb.ForwardReply(session_id=99, epoch=1, token=pb.TokenResult(token_id=5))
    data = frame(pb.DATA_FRAME_REPLY, token.SerializeToString())
    end = end_of(stream(fleet[0], hello(pb.DATA_STREAM_LOOP, TOKEN) + data))
    assert end.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "no forward-mode session 99" in end.message


def test_a_silent_peer_gets_heartbeats_and_is_dropped(fleet: list[WorkerProcess]) -> None:
    """A stage that opens a stream and then says nothing: the worker sends ALIVE frames, and
    drops the stream after keepalive x 1.5 of silence, with UNAVAILABLE."""
    t0 = time.monotonic()
    frames = stream(fleet[1], hello(pb.DATA_STREAM_FORWARD, TOKEN), half_close=False)
    took = time.monotonic() - t0
    end = end_of(frames)
    assert end.code == grpc.StatusCode.UNAVAILABLE.value[0] and "sent nothing" in end.message
    assert KEEPALIVE_MS * 1.5 / 1000 - 0.05 < took < 5.0
    assert any(kind == pb.DATA_FRAME_ALIVE for kind, _ in frames[:-1])


def test_the_worker_serves_on_and_the_route_generates(fleet: list[WorkerProcess]) -> None:
    """After every refusal above, the route generates; the same tokens as over gRPC links."""
    from dgr_route.security import Security

    addresses = [w.address for w in fleet]
    route = Route.open(addresses, timeout=30, security=Security(token=TOKEN))
    try:
        tokens = list(route.generate(list(range(1000, 1040)), 12))
    finally:
        route.close()
    assert len(tokens) == 12
    assert [w.sessions(token=TOKEN) for w in fleet] == [0, 0, 0]


def accepted_sockets(pid: int, port: int) -> list[socket.socket]:
    """Copies (pidfd_getfd) of the connections worker `pid` accepted on `port`."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "01":  # ESTABLISHED
                inodes.add(f[9])
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = libc.syscall(434, pid, 0)  # pidfd_open
    if pidfd < 0:
        pytest.skip(f"pidfd_open: {os.strerror(ctypes.get_errno())}")
    copies = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except FileNotFoundError:
                continue
            if target.removeprefix("socket:[").removesuffix("]") not in inodes:
                continue
            local = libc.syscall(438, pidfd, int(fd), 0)  # pidfd_getfd
            if local < 0:
                code = ctypes.get_errno()
                if code in (errno.EPERM, errno.ENOSYS):
                    pytest.skip(f"pidfd_getfd: {os.strerror(code)}")
                continue  # closed meanwhile
            copies.append(socket.socket(fileno=local))
    finally:
        os.close(pidfd)
    return copies


def test_every_connection_the_worker_accepts_sends_at_once(fleet: list[WorkerProcess]) -> None:
    """TCP_NODELAY on gRPC connections as on data streams: the worker accepts both on its own
    listener and hands gRPC's to the gRPC server, which sets no socket option on a socket it did
    not accept. Without it, Nagle held the head's token reply to the coordinator until the
    client's delayed ACK (30-40 ms per generation)."""
    worker = fleet[1]
    host, port = worker.address.rsplit(":", 1)
    with (
        grpc.insecure_channel(worker.address) as channel,
        socket.create_connection((host, int(port)), timeout=10) as data,
    ):
        # a call on a channel that stays open while its socket is read (WorkerProcess.sessions
        # closes its own)
        pb_grpc.ShardServiceStub(channel).Health(
            pb.HealthRequest(), timeout=10, metadata=[("authorization", f"Bearer {TOKEN}")]
        )
        data.sendall(b"DGR1")
        time.sleep(0.2)  # the worker classifies the data stream by its first bytes
        copies = accepted_sockets(worker.proc.pid, int(port))
        try:
            assert len(copies) >= 2, "the worker should hold the gRPC and the data connection"
            for s in copies:
                assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0, s
        finally:
            for s in copies:
                s.close()


def test_data_and_grpc_links_give_the_same_tokens(smollm2: Path) -> None:
    out = {}
    for links in ("data", "grpc"):
        workers = start_stages(smollm2, LAYOUT, threads=1, n_ctx=512, extra=["--links", links])
        try:
            route = Route.open([w.address for w in workers], timeout=30)
            out[links] = list(route.generate(list(range(1000, 1100)), 24))
            route.close()
        finally:
            for w in workers:
                w.stop()
    assert out["data"] == out["grpc"] and len(out["data"]) == 24


def test_a_stage_without_the_token_is_named(smollm2: Path, fleet: list[WorkerProcess]) -> None:
    """A head without the route's token: the middle stage refuses its data stream, and the
    coordinator's error names that stage."""
    from dgr_route.security import Security

    descriptor = descriptor_args(smollm2)
    impostor = start_worker(smollm2, 0, 10, descriptor=descriptor, threads=1, n_ctx=512)
    try:
        addresses = [impostor.address, fleet[1].address, fleet[2].address]
        route = Route.open(addresses, timeout=10, security=Security(token=TOKEN))
        with pytest.raises(RouteError) as info:
            list(route.generate([1, 2, 3], 4))
        route.close()
    finally:
        impostor.stop()
    assert info.value.stage == 1 and info.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "missing authorization" in info.value.what
