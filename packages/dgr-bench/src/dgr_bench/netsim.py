"""A userspace WAN link (this kernel has no netem): `dgr-netsim` (native/netsim), a TCP proxy
that delivers every byte `latency` later than it arrived, in order, through a link of `bandwidth`
bits per second, in both directions. `start_link` runs one in front of a worker;
`python -m dgr_bench.netsim --upstream HOST:PORT --latency-ms 10 [--mbps 100]` runs one by hand
and prints `DGR-NETSIM-READY port=N` once it listens.

It is native because the link must cost the route nothing but its delay: the asyncio proxy it
replaced woke an interpreter two or three times per message on the cores the stages compute on,
which charged 0.5-1.7 ms per decode token to a 3-stage route at 1 ms per link (measured against
it, interleaved, on this VM), time no real link takes from its hosts. Each direction of a
connection is a reader thread (blocking receive, stamps the chunk with its due time) and a writer
thread (sleeps until then on CLOCK_MONOTONIC, timer slack 1 ns, and sends).

Faults for chaos runs, as lines on the proxy's stdin (`LinkProcess.fault`):
- `blackhole on|off`: from now on every byte is dropped and the connections stay open, no FIN
  and no RST, as a dead path looks to both ends; a connection that lost bytes stays dead;
- `reset`: every open connection is closed with an RST on both sides;
- `corrupt N`: flip one byte in each of the next N chunks of at least 1 KiB (boundaries) that
  pass toward the upstream;
- `delay MS`: add MS to the one-way latency (a spike; `delay 0` ends it);
- `stats`: the link's accuracy so far (`LinkProcess.stats`).

A chunk is due `latency` after the kernel received it (its SO_TIMESTAMPNS stamp), not after the
proxy's reader woke for it, and each writer aims its timer early by the least of its recent
oversleeps: the reader's wake-up (tens of microseconds on this VM, more beside busy stages) and
the timer's (about 23 us at 1 ms, 85 us at 10 ms) then stay off the link. Measured behind a 3-stage
route at 1 ms per link, 2 threads, 8 interleaved rounds against the proxy before: 0.94-0.99x the
time per token (median 0.97), decode-sized chunks leaving 16-45 us after their due time (median),
none early.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


def binary() -> Path:
    from dgr_native.build import netsim_binary

    return netsim_binary()


@dataclass
class LinkProcess:
    proc: subprocess.Popen[str]
    address: str

    def fault(self, command: str) -> None:
        """Turn a fault on or off (`blackhole on`, `reset`, `corrupt 1`, `delay 200`); returns
        once the proxy has applied it. Only for links started with `control=True`."""
        self._ask(command)

    def stats(self) -> dict[str, float]:
        """The link's accuracy so far: how late it delivered chunks against their due time
        (percentiles in us, `small_` for chunks under 8 KiB, a decode step's), and the reader's
        mean wake-up after the bytes arrived (`stamp_lag_mean_us`, kept off the link's delay by
        the kernel's receive timestamp). Only for links started with `control=True`."""
        return {k: float(v) for k, v in (f.split("=", 1) for f in self._ask("stats").split()[1:])}

    def _ask(self, command: str) -> str:
        """One control command and the proxy's answer (`DGR-NETSIM-OK ...`)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer.startswith("DGR-NETSIM-OK"):
            raise RuntimeError(f"netsim did not apply {command!r}: {answer!r}")
        return answer

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def start_link(
    upstream: str, latency_ms: float, mbps: float | None = None, control: bool = False
) -> LinkProcess:
    """A proxy in front of `upstream` adding `latency_ms` each way (and a bandwidth limit);
    with `control`, faults can be injected into it (LinkProcess.fault)."""
    cmd = [str(binary()), "--upstream", upstream, "--latency-ms", str(latency_ms)]
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
    """Run dgr-netsim in the foreground with these arguments (its usage says which)."""
    args = sys.argv[1:] if argv is None else argv
    os.execv(binary(), [str(binary()), *args])


if __name__ == "__main__":
    sys.exit(main())
