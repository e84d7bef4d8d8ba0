"""The front end's concurrency, on the event loop: admission and the bridge to the route.

The route is synchronous gRPC. A request that waits for admission waits on the event loop, never
in a thread, so queued requests take nothing that /health or a new request needs; only admitted
generations use threads, one short call at a time (each next piece). A generation whose client
goes away, stream or not, is closed from a thread of its own within a second: its stage
sessions end and its admission slot passes on.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from starlette.concurrency import run_in_threadpool

WATCH_S = 0.25  # how often a generation checks that its client is still there


class Full(Exception):
    """Admission refused: as many running and waiting as allowed."""


class Admission:
    """At most `limit` generations at once and `queue` more waiting; beyond that, Full."""

    def __init__(self, limit: int, queue: int) -> None:
        if limit < 1 or queue < 0:
            raise ValueError(f"admission needs limit >= 1 and queue >= 0, not {limit} and {queue}")
        self.limit, self.queue = limit, queue
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def waiting(self) -> int:
        return sum(not w.done() for w in self._waiters)

    async def acquire(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.running < self.limit and not self.waiting:
            self.running += 1
            return
        if self.waiting >= self.queue:
            raise Full(f"{self.running} requests running and {self.waiting} waiting")
        slot: asyncio.Future[None] = self._loop.create_future()
        self._waiters.append(slot)
        try:
            await slot  # release() hands its slot over, running stays
        except asyncio.CancelledError:
            if slot.done() and not slot.cancelled():
                self._hand_on()  # handed a slot just as it gave up: pass it on
            raise
        finally:
            if slot in self._waiters:
                self._waiters.remove(slot)

    def release(self) -> None:
        """From any thread."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._hand_on)

    def _hand_on(self) -> None:
        while self._waiters:
            slot = self._waiters.popleft()
            if not slot.done():
                slot.set_result(None)
                return
        self.running -= 1


class Bridge:
    """A synchronous iterator (a generation's pieces) read from the event loop: each next()
    in a worker thread; closed once, from a thread of its own (closing a route generation waits
    for its stages to end), when the reader stops for any reason or `gone()` says the client
    left. `on_close` runs after the close (the admission slot, metrics). `start()` reads the
    first item before anyone iterates (its error raised there); iteration yields it first."""

    def __init__(
        self,
        source: Iterator[Any],
        on_close: Callable[[], None],
        gone: Callable[[], Any] | None = None,
    ) -> None:
        self._source = source
        self._on_close = on_close
        self._gone = gone
        self._lock = threading.Lock()  # next() and close() never overlap
        self._closed = False
        self._watch: asyncio.Task[None] | None = None
        self.first_at = self.last_at = 0.0
        self._started: tuple[bool, Any] | None = None  # start()'s item, not yet yielded

    def _next(self) -> tuple[bool, Any]:
        with self._lock:
            if self._closed:
                return False, None
            try:
                item = next(self._source)
            except StopIteration:
                return False, None
        now = time.perf_counter()
        self.first_at = self.first_at or now
        self.last_at = now
        return True, item

    async def next(self) -> tuple[bool, Any]:
        if self._watch is None and self._gone is not None:
            self._watch = asyncio.create_task(self._watching())
        return await run_in_threadpool(self._next)

    async def start(self) -> None:
        try:
            self._started = await self.next()
        except BaseException:
            self.close()
            raise

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            more, item = self._started or await self.next()
            self._started = None
            while more:
                yield item
                more, item = await self.next()
        finally:
            self.close()

    async def _watching(self) -> None:
        assert self._gone is not None
        while not self._closed:
            await asyncio.sleep(WATCH_S)
            if await self._gone():
                self.close()
                return

    def close(self) -> None:
        """Idempotent, never blocks the caller."""
        if self._closed:
            return
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()

        def closing() -> None:
            with self._lock:  # after a next() in progress
                close = getattr(self._source, "close", None)
                if close is not None:
                    close()
            self._on_close()

        threading.Thread(target=closing, name="dgr-serve-close", daemon=True).start()
