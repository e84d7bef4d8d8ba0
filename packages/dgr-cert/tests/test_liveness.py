"""Liveness: a peer that disappears without a reset (a blackholed link: bytes dropped, the
connection held open, no FIN, no RST) frees its sessions within the stated bound, keepalive +
keepalive / 2 plus the link's close grace, on every stage; the coordinator gets a typed error
naming the stage behind the dead link."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from dgr.v1 import shard_pb2 as pb
from dgr.v1 import shard_pb2_grpc as pb_grpc
from dgr_bench.netsim import LinkProcess, start_link
from dgr_cli.workers import WorkerProcess, start_stages
from dgr_route.route import Route, RouteError
from dgr_wire.codec import FNV_OFFSET

KEEPALIVE_MS = 1000
# keepalive + its timeout (half of it), the 2 s a closing link waits for its peer, and slack for
# a loaded 2-core machine
BOUND_S = KEEPALIVE_MS / 1000 * 1.5 + 2.0 + 2.5
LAYOUT = [(0, 10), (10, 20), (20, 30)]


@pytest.fixture()
def chain(smollm2: Path) -> Iterator[tuple[list[WorkerProcess], list[LinkProcess]]]:
    workers = start_stages(
        smollm2, LAYOUT, threads=1, n_ctx=4096, extra=["--keepalive-ms", str(KEEPALIVE_MS)]
    )
    links = [start_link(w.address, 0.0, control=True) for w in workers]
    yield workers, links
    for link in links:
        link.stop()
    for w in workers:
        w.stop()


def sessions(workers: list[WorkerProcess]) -> list[int]:
    return [w.sessions() for w in workers]


def freed_within(workers: list[WorkerProcess], t0: float) -> float:
    while time.monotonic() - t0 < 30:
        if sum(sessions(workers)) == 0:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"sessions still held 30 s after the link died: {sessions(workers)}")


def test_a_vanished_coordinator_frees_the_route(
    chain: tuple[list[WorkerProcess], list[LinkProcess]],
) -> None:
    """The coordinator's link to the head goes dark mid-generation: the head's keepalive ends
    the stream, and every stage frees the session."""
    workers, links = chain
    addresses = [w.address for w in workers]
    requests: queue.Queue[pb.ForwardRequest | None] = queue.Queue()
    requests.put(
        pb.ForwardRequest(
            session_id=41,
            expect=pb.CacheExpectation(epoch=1, prefix_hash=FNV_OFFSET),
            token_ids=list(range(1000, 1032)),
            route=pb.RouteSpec(stages=addresses, stage_index=0),
            last_chunk=True,
            max_tokens=4000,  # far longer than the test: only the dead link can end it
        )
    )
    channel = grpc.insecure_channel(links[0].address)
    replies = pb_grpc.ShardServiceStub(channel).Forward(iter(requests.get, None), timeout=120)
    next(replies)
    assert sum(sessions(workers)) == 3
    links[0].fault("blackhole on")
    t0 = time.monotonic()
    assert freed_within(workers, t0) < BOUND_S
    requests.put(None)
    channel.close()


def test_a_dead_link_inside_the_route_is_named_and_frees_every_stage(
    chain: tuple[list[WorkerProcess], list[LinkProcess]],
) -> None:
    """The link into the middle stage goes dark: the head's keepalive on that link fails, the
    coordinator gets a RouteError naming stage 1, and all three stages free the session."""
    workers, links = chain
    addresses = [link.address for link in links]
    route = Route.open(addresses, timeout=60, peers=addresses)
    stream = route.generate(list(range(1000, 1032)), 4000)
    next(stream)
    links[1].fault("blackhole on")
    t0 = time.monotonic()
    with pytest.raises(RouteError) as info:
        for _ in stream:
            pass
    named = time.monotonic() - t0
    assert info.value.stage == 1, info.value
    assert named < BOUND_S
    links[1].fault("blackhole off")
    assert freed_within(workers, t0) < BOUND_S + 2.0
    route.close()
