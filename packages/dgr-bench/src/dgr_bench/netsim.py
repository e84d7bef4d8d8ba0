"""A userspace WAN link (this kernel has no netem): a TCP proxy that delivers every byte `latency`
later than it arrived, in order, through a link of `bandwidth` bits per second, in both
directions. `python -m dgr_bench.netsim --upstream HOST:PORT --latency-ms 10 [--mbps 100]`
prints `DGR-NETSIM-READY port=N` once it listens; `start_link` runs one as a subprocess so the
proxy never competes with the caller's interpreter.

Faults for chaos runs, as lines on the proxy's stdin (`LinkProcess.fault`):
- `blackhole on|off`: from now on every byte is dropped and the connections stay open, no FIN
  and no RST, as a dead path looks to both ends; a connection that lost bytes stays dead;
- `reset`: every open connection is closed with an RST on both sides;
- `corrupt N`: flip one byte in each of the next N chunks of at least 1 KiB (boundaries) that
  pass toward the upstream;
- `delay MS`: add MS to the one-way latency (a spike; `delay 0` ends it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Link:
    latency_s: float
    bits_per_s: float | None = None  # None: unlimited

    def transmit_s(self, n_bytes: int) -> float:
        return 0.0 if self.bits_per_s is None else n_bytes * 8 / self.bits_per_s


@dataclass
class Faults:
    """What a chaos run has turned on in this link (see the module docstring)."""

    blackhole: bool = False
    corrupt: int = 0
    extra_s: float = 0.0
    open: set[tuple[socket.socket, socket.socket]] = field(default_factory=set)

    def command(self, line: str) -> None:
        word, _, arg = line.strip().partition(" ")
        if word == "blackhole":
            self.blackhole = arg.strip() == "on"
        elif word == "corrupt":
            self.corrupt += int(arg)
        elif word == "delay":
            self.extra_s = float(arg) / 1000
        elif word == "reset":
            for pair in list(self.open):
                for sock in pair:
                    with contextlib.suppress(OSError):
                        # linger 0: close() sends an RST instead of a FIN
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                        sock.shutdown(socket.SHUT_RDWR)
            self.open.clear()


@dataclass
class _Conn:
    dead: bool = False  # dropped bytes: nothing more goes through, both ways


async def _pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    link: Link,
    faults: Faults | None = None,
    conn: _Conn | None = None,
    upstream: bool = False,
) -> None:
    """Copy one direction: each chunk leaves `latency` after it arrived, after the link has
    finished sending the chunks before it (serialization at `bandwidth`)."""
    faults = faults or Faults()
    conn = conn or _Conn()
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
            if faults.blackhole:
                conn.dead = True
            if conn.dead:
                continue
            if upstream and faults.corrupt > 0 and len(data) >= 1024:
                faults.corrupt -= 1
                flipped = bytearray(data)
                flipped[len(data) * 3 // 4] ^= 0x5A
                data = bytes(flipped)
            now = time.monotonic()
            link_free = max(link_free, now) + link.transmit_s(len(data))
            queue.put_nowait((link_free + link.latency_s + faults.extra_s, data))
    except ConnectionError:
        pass
    finally:
        queue.put_nowait(None)
        await sender


async def _serve(
    listen: tuple[str, int], upstream: tuple[str, int], link: Link, control: bool = False
) -> None:
    faults = Faults()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if faults.blackhole:  # a dead path: the connection opens, nothing ever passes
            while await reader.read(1 << 16):
                pass
            return
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
        pair = (down_sock, up_sock)
        faults.open.add(pair)
        conn = _Conn()
        try:
            await asyncio.gather(
                _pump(reader, up_writer, link, faults, conn, upstream=True),
                _pump(up_reader, writer, link, faults, conn),
                return_exceptions=True,
            )
        finally:
            faults.open.discard(pair)

    async def commands() -> None:
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            faults.command(line)
            print("DGR-NETSIM-OK", flush=True)

    server = await asyncio.start_server(handle, *listen)
    port = server.sockets[0].getsockname()[1]
    print(f"DGR-NETSIM-READY port={port}", flush=True)
    if control:
        asyncio.get_running_loop().create_task(commands())
    async with server:
        await server.serve_forever()


def _address(value: str) -> tuple[str, int]:
    host, port = value.rsplit(":", 1)
    return host, int(port)


@dataclass
class LinkProcess:
    proc: subprocess.Popen[str]
    address: str

    def fault(self, command: str) -> None:
        """Turn a fault on or off (`blackhole on`, `reset`, `corrupt 1`, `delay 200`); returns
        once the proxy has applied it. Only for links started with `control=True`."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer.startswith("DGR-NETSIM-OK"):
            raise RuntimeError(f"netsim did not apply {command!r}: {answer!r}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def start_link(
    upstream: str, latency_ms: float, mbps: float | None = None, control: bool = False
) -> LinkProcess:
    """A proxy in front of `upstream` adding `latency_ms` each way (and a bandwidth limit);
    with `control`, faults can be injected into it (LinkProcess.fault)."""
    cmd = [sys.executable, "-m", "dgr_bench.netsim", "--upstream", upstream]
    cmd += ["--latency-ms", str(latency_ms)]
    if mbps is not None:
        cmd += ["--mbps", str(mbps)]
    if control:
        cmd.append("--control")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stdin=subprocess.PIPE if control else None, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("DGR-NETSIM-READY port="):
        proc.kill()
        raise RuntimeError(f"netsim for {upstream} did not start: {line!r}")
    return LinkProcess(proc, f"127.0.0.1:{line.split('=', 1)[1].strip()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dgr_bench.netsim")
    parser.add_argument("--upstream", required=True, type=_address)
    parser.add_argument("--listen", default="127.0.0.1:0", type=_address)
    parser.add_argument("--latency-ms", type=float, default=0.0, help="added one-way latency")
    parser.add_argument("--mbps", type=float, help="link bandwidth in Mbit/s (default: unlimited)")
    parser.add_argument("--control", action="store_true", help="read fault commands on stdin")
    args = parser.parse_args(argv)
    link = Link(args.latency_ms / 1000, args.mbps * 1e6 if args.mbps else None)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args.listen, args.upstream, link, args.control))
    return 0


if __name__ == "__main__":
    sys.exit(main())
