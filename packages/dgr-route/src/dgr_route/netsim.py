"""A userspace WAN link (this kernel has no netem): a TCP proxy that delivers every byte `latency`
later than it arrived, in order, through a link of `bandwidth` bits per second, in both
directions. `python -m dgr_route.netsim --upstream HOST:PORT --latency-ms 10 [--mbps 100]`
prints `DGR-NETSIM-READY port=N` once it listens; `start_link` runs one as a subprocess so the
proxy never competes with the caller's interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    latency_s: float
    bits_per_s: float | None = None  # None: unlimited

    def transmit_s(self, n_bytes: int) -> float:
        return 0.0 if self.bits_per_s is None else n_bytes * 8 / self.bits_per_s


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link) -> None:
    """Copy one direction: each chunk leaves `latency` after it arrived, after the link has
    finished sending the chunks before it (serialization at `bandwidth`)."""
    queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

    async def deliver() -> None:
        while (item := await queue.get()) is not None:
            due, data = item
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.create_task(deliver())
    link_free = time.monotonic()
    try:
        while data := await reader.read(1 << 16):
            now = time.monotonic()
            link_free = max(link_free, now) + link.transmit_s(len(data))
            queue.put_nowait((link_free + link.latency_s, data))
    except ConnectionError:
        pass
    finally:
        queue.put_nowait(None)
        await sender


async def _serve(listen: tuple[str, int], upstream: tuple[str, int], link: Link) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*upstream)
        except OSError:
            writer.close()
            return
        up_sock = up_writer.get_extra_info("socket")
        down_sock = writer.get_extra_info("socket")
        for sock in (up_sock, down_sock):
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(
            _pump(reader, up_writer, link), _pump(up_reader, writer, link), return_exceptions=True
        )

    server = await asyncio.start_server(handle, *listen)
    port = server.sockets[0].getsockname()[1]
    print(f"DGR-NETSIM-READY port={port}", flush=True)
    async with server:
        await server.serve_forever()


def _address(value: str) -> tuple[str, int]:
    host, port = value.rsplit(":", 1)
    return host, int(port)


@dataclass
class LinkProcess:
    proc: subprocess.Popen[str]
    address: str

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def start_link(upstream: str, latency_ms: float, mbps: float | None = None) -> LinkProcess:
    """A proxy in front of `upstream` adding `latency_ms` each way (and a bandwidth limit)."""
    cmd = [sys.executable, "-m", "dgr_route.netsim", "--upstream", upstream]
    cmd += ["--latency-ms", str(latency_ms)]
    if mbps is not None:
        cmd += ["--mbps", str(mbps)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("DGR-NETSIM-READY port="):
        proc.kill()
        raise RuntimeError(f"netsim for {upstream} did not start: {line!r}")
    return LinkProcess(proc, f"127.0.0.1:{line.split('=', 1)[1].strip()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dgr_route.netsim")
    parser.add_argument("--upstream", required=True, type=_address)
    parser.add_argument("--listen", default="127.0.0.1:0", type=_address)
    parser.add_argument("--latency-ms", type=float, default=0.0, help="added one-way latency")
    parser.add_argument("--mbps", type=float, help="link bandwidth in Mbit/s (default: unlimited)")
    args = parser.parse_args(argv)
    link = Link(args.latency_ms / 1000, args.mbps * 1e6 if args.mbps else None)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args.listen, args.upstream, link))
    return 0


if __name__ == "__main__":
    sys.exit(main())
