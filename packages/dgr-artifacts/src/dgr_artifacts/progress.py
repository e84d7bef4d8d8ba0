"""Progress for long byte streams: a bar with bytes/s on a terminal, quiet lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(
        self, label: str, total: int, stream: TextIO | None = None, line_every_s: float = 5.0
    ) -> None:
        self.label, self.total = label, max(total, 1)
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = time.monotonic()
        self.last = 0.0
        self.done = 0
        self.line_every_s = line_every_s

    def rate(self) -> float:
        return self.done / max(time.monotonic() - self.start, 1e-9)

    def update(self, done: int) -> None:
        self.done = done
        now = time.monotonic()
        if self.tty:
            if now - self.last >= 0.1 or done >= self.total:
                frac = done / self.total
                bar = "#" * int(frac * 30)
                self.stream.write(
                    f"\r{self.label} [{bar:<30}] {frac:6.1%} "
                    f"{done / 2**20:,.0f}/{self.total / 2**20:,.0f} MiB "
                    f"{self.rate() / 2**20:,.1f} MiB/s"
                )
                self.stream.flush()
                self.last = now
        elif now - self.last >= self.line_every_s:
            self.stream.write(
                f"{self.label}: {done / self.total:.0%} ({done} of {self.total} "
                f"bytes, {self.rate() / 2**20:.1f} MiB/s)\n"
            )
            self.last = now

    def finish(self) -> None:
        self.update(self.done)
        self.stream.write(
            ("\n" if self.tty else "") + f"{self.label}: done, {self.done} bytes "
            f"in {time.monotonic() - self.start:.1f} s "
            f"({self.rate() / 2**20:.1f} MiB/s)\n"
        )
