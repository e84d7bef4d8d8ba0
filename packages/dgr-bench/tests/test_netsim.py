"""The simulated WAN link (a delaying TCP proxy): bytes arrive intact and in order, each way
`latency` later, at no more than the link's bandwidth."""

from __future__ import annotations

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


def test_bandwidth_is_limited(echo: str) -> None:
    link = start_link(echo, latency_ms=0, mbps=1.0)
    try:
        _, elapsed = round_trip(link.address, b"x" * 50_000)  # 0.4 s each way at 1 Mbit/s
        assert elapsed >= 0.7
    finally:
        link.stop()
