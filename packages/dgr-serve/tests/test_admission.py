"""The front end's admission queue and its bridge from the synchronous route to the event loop,
on their own (no server, no workers): who runs, who waits, who is refused, where a slot goes when
a waiter gives up, and that a generation is closed once, off the loop, whatever ends it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
from dgr_serve.admission import WATCH_S, Admission, Bridge, Full


def test_limit_runs_queue_waits_in_order_and_beyond_is_refused() -> None:
    async def main() -> None:
        adm = Admission(limit=2, queue=2)
        await adm.acquire()
        await adm.acquire()
        order: list[str] = []

        async def wait(name: str) -> None:
            await adm.acquire()
            order.append(name)

        a = asyncio.create_task(wait("a"))
        await asyncio.sleep(0)
        b = asyncio.create_task(wait("b"))
        await asyncio.sleep(0)
        assert (adm.running, adm.waiting) == (2, 2)
        with pytest.raises(Full, match="2 requests running and 2 waiting"):
            await adm.acquire()
        adm.release()  # from "any thread": here the loop's
        await a
        assert order == ["a"] and (adm.running, adm.waiting) == (2, 1)
        threading.Thread(target=adm.release).start()  # from another thread
        await asyncio.wait_for(b, 2)
        assert order == ["a", "b"]
        for _ in range(2):
            adm.release()
        await asyncio.sleep(0.01)
        assert (adm.running, adm.waiting) == (0, 0)

    asyncio.run(main())


def test_a_waiter_that_gives_up_takes_no_slot_even_one_handed_to_it() -> None:
    async def main() -> None:
        adm = Admission(limit=1, queue=4)
        await adm.acquire()
        gone = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0)
        gone.cancel()  # gives up while waiting
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert adm.waiting == 0
        handed = asyncio.create_task(adm.acquire())
        after = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0)
        adm.release()
        await asyncio.sleep(0)  # the slot is handed to `handed`, which has not run yet
        handed.cancel()  # and gives up now: the slot passes on to `after`
        with pytest.raises(asyncio.CancelledError):
            await handed
        await asyncio.wait_for(after, 2)
        assert (adm.running, adm.waiting) == (1, 0)

    asyncio.run(main())


class Source:
    def __init__(self, items: list[int], delay: float = 0.0) -> None:
        self.items, self.delay = items, delay
        self.closed_by: str | None = None

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        time.sleep(self.delay)
        if not self.items:
            raise StopIteration
        return self.items.pop(0)

    def close(self) -> None:
        self.closed_by = threading.current_thread().name


def test_the_bridge_yields_every_item_then_closes_once_off_the_loop() -> None:
    closes: list[str] = []

    async def main() -> list[int]:
        source = Source([1, 2, 3])
        bridge = Bridge(source, lambda: closes.append(threading.current_thread().name))
        await bridge.start()
        got = [item async for item in bridge]
        bridge.close()  # idempotent
        await asyncio.sleep(0.1)
        assert source.closed_by == "dgr-serve-close"
        assert bridge.first_at and bridge.last_at >= bridge.first_at
        return got

    assert asyncio.run(main()) == [1, 2, 3]
    assert closes == ["dgr-serve-close"]


def test_a_client_that_goes_away_closes_its_generation_within_a_watch() -> None:
    async def main() -> float:
        source = Source(list(range(1000)), delay=0.01)
        closed = asyncio.Event()
        loop = asyncio.get_running_loop()
        left = False

        async def gone() -> bool:
            return left

        bridge = Bridge(source, lambda: loop.call_soon_threadsafe(closed.set), gone)
        await bridge.start()
        left = True
        t0 = time.perf_counter()
        await asyncio.wait_for(closed.wait(), 2)
        return time.perf_counter() - t0

    waited = asyncio.run(main())
    assert waited < WATCH_S + 0.5


def test_an_error_reading_the_first_item_closes_the_generation() -> None:
    closes: list[int] = []

    def failing() -> Iterator[int]:
        raise RuntimeError("stage refused")
        yield 0

    async def main() -> None:
        bridge = Bridge(failing(), lambda: closes.append(1))
        with pytest.raises(RuntimeError, match="stage refused"):
            await bridge.start()
        await asyncio.sleep(0.1)

    asyncio.run(main())
    assert closes == [1]
