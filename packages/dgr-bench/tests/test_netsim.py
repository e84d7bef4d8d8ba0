"""The simulated WAN link (a delaying TCP proxy): bytes arrive intact and in order, each way
`latency` later, at no more than the link's bandwidth."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from dgr_bench.netsim import start_link


@pytest.fixture
def echo() -> Iterator[str]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(1 << 16):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    server.close()


def round_trip(address: str, payload: bytes) -> tuple[bytes, float]:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        t0 = time.perf_counter()
        s.sendall(payload)
        got = b""
        while len(got) < len(payload):
            got += s.recv(1 << 16)
        return got, time.perf_counter() - t0


def test_latency_is_added_each_way_and_bytes_arrive_intact(echo: str) -> None:
    link = start_link(echo, latency_ms=20)
    try:
        payload = bytes(range(256)) * 4096  # 1 MiB
        got, _ = round_trip(link.address, payload)
        assert got == payload
        _, rtt = round_trip(link.address, b"ping")
        assert 0.040 <= rtt < 0.200
    finally:
        link.stop()


def test_small_messages_leave_on_time_and_never_early(echo: str) -> None:
    """What bench-wan's floors assume: a decode-sized message crosses in `latency`, not one
    thread wake-up or timer oversleep later, and never sooner (the writers aim their timers early
    by their own oversleep; an aim too eager would shorten the link)."""
    latency_ms = 5
    link = start_link(echo, latency_ms=latency_ms, control=True)
    try:
        host, port = link.address.rsplit(":", 1)
        rtts = []
        with socket.create_connection((host, int(port))) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for i in range(30):
                t0 = time.perf_counter()
                s.sendall(b"%04d" % i)
                got = b""
                while len(got) < 4:
                    got += s.recv(16)
                rtts.append(time.perf_counter() - t0)
                assert got == b"%04d" % i
        stats = link.stats()
        assert stats["small_chunks"] == 60  # 30 each way
        assert min(rtts) >= 2 * latency_ms / 1000  # each way at least the latency
        assert stats["small_late_p10_us"] >= -20  # hardly any chunk leaves before it is due
        assert stats["small_late_p50_us"] < 1000  # and most within a millisecond after
    finally:
        link.stop()


def test_bandwidth_is_limited(echo: str) -> None:
    link = start_link(echo, latency_ms=0, mbps=1.0)
    try:
        _, elapsed = round_trip(link.address, b"x" * 50_000)  # 0.4 s each way at 1 Mbit/s
        # at least the way there: the echo sends back what came through while the rest is still
        # on its way, as over a real full-duplex link, so the two ways overlap by as much as the
        # payload arrived in pieces (0.8 s when it arrives at once; 0.66 s seen in a CI run)
        assert elapsed >= 0.4
    finally:
        link.stop()


def test_faults_delay_corrupt_blackhole_and_reset(echo: str) -> None:
    link = start_link(echo, latency_ms=0, control=True)
    try:
        link.fault("delay 100")
        _, rtt = round_trip(link.address, b"ping")
        assert rtt >= 0.2  # the spike applies each way
        link.fault("delay 0")
        _, rtt = round_trip(link.address, b"ping")
        assert rtt < 0.1

        payload = bytes(range(256)) * 8  # 2 KiB: a chunk the corruption picks
        link.fault("corrupt 1")
        got, _ = round_trip(link.address, payload)
        assert sum(a != b for a, b in zip(got, payload, strict=True)) == 1
        assert round_trip(link.address, payload)[0] == payload  # only the next chunk

        host, port = link.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as held:
            held.sendall(b"x")
            assert held.recv(16) == b"x"
            link.fault("reset")
            held.settimeout(5)
            # closed: a FIN then the RST (recv gives b""), or the RST outright
            with contextlib.suppress(ConnectionResetError):
                assert held.recv(16) == b""

        link.fault("blackhole on")
        with socket.create_connection((host, int(port))) as dead:
            dead.sendall(b"lost")
            dead.settimeout(0.3)
            with pytest.raises(TimeoutError):
                dead.recv(16)  # opened, and nothing ever comes back: no FIN, no RST
        link.fault("blackhole off")
        assert round_trip(link.address, b"back")[0] == b"back"
    finally:
        link.stop()


def test_bad_arguments_are_refused_by_name() -> None:
    import subprocess

    from dgr_bench.netsim import binary

    out = subprocess.run(
        [str(binary()), "--upstream", "127.0.0.1:1", "--latency-ms", "nan"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert "--latency-ms" in out.stderr
