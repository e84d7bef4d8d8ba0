"""Real dgr-shard-worker processes on loopback, driven by the coordinator: greedy output equals
single-process llama.cpp, route checks, bad messages, dead peers, health and drain."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from dgr.v1 import shard_pb2 as pb
from dgr.v1 import shard_pb2_grpc as pb_grpc
from dgr_cli.workers import WorkerProcess, descriptor_args, start_worker
from dgr_prd.native_pin import llama_pin, patch_stack_hash
from dgr_prd.paths import find_root
from dgr_route.route import OPEN_ROUTES, Draft, Route, RouteError
from dgr_wire.codec import FNV_OFFSET, encode
from grpc_health.v1 import health_pb2, health_pb2_grpc

LAYOUTS = {
    2: [(0, 15), (15, 30)],
    3: [(0, 10), (10, 20), (20, 30)],
    4: [(0, 8), (8, 15), (15, 23), (23, 30)],
}


@pytest.fixture(scope="module")
def descriptor(smollm2: Path) -> list[str]:
    return descriptor_args(smollm2)


@pytest.fixture(scope="module")
def reference(smollm2: Path) -> tuple[list[int], list[int]]:
    from dgr_native.parity import reference_run

    prompt, _, tokens = reference_run(smollm2, 63)
    return prompt.tolist(), tokens


@pytest.fixture(scope="module")
def workers(
    smollm2: Path, descriptor: list[str], worker_pool: Any
) -> dict[tuple[int, int], WorkerProcess]:
    ranges = sorted({r for layout in LAYOUTS.values() for r in layout} | {(0, 20), (10, 30)})
    return {r: worker_pool.get(smollm2, *r, descriptor=descriptor, n_ctx=512) for r in ranges}


def route_of(
    workers: dict[tuple[int, int], WorkerProcess],
    layout: list[tuple[int, int]],
    timeout: float = 30.0,
    mode: str = "forward",
) -> Route:
    return Route.open([workers[r].address for r in layout], timeout=timeout, mode=mode)


@pytest.mark.parametrize("mode", ["forward", "relay"])
@pytest.mark.parametrize("n_stages", [2, 3, 4])
def test_greedy_output_equals_single_process(
    workers: dict[tuple[int, int], WorkerProcess],
    reference: tuple[list[int], list[int]],
    n_stages: int,
    mode: str,
) -> None:
    prompt, expected = reference
    route = route_of(workers, LAYOUTS[n_stages], mode=mode)
    got = list(route.generate(prompt, 64))
    route.close()
    assert got == expected[:64]
    for r in LAYOUTS[n_stages]:  # every stage frees the session when its stream ends
        wait_idle(workers[r].address)


def test_forward_mode_stops_at_stop_ids_and_max_tokens(
    workers: dict[tuple[int, int], WorkerProcess], reference: tuple[list[int], list[int]]
) -> None:
    prompt, expected = reference
    route = route_of(workers, LAYOUTS[3])
    assert list(route.generate(prompt, 5)) == expected[:5]
    stop = expected[6]
    first = expected.index(stop)
    assert list(route.generate(prompt, 64, stop={stop})) == expected[: first + 1]
    assert list(route.generate(prompt, 0)) == []
    # nothing to prefill is the caller's error, at once (it waited out the route's timeout for
    # a token no stage could send), and the route goes on serving
    started = time.monotonic()
    with pytest.raises(ValueError, match="the prompt is empty"):
        list(route.generate([], 5))
    with pytest.raises(ValueError, match="max_tokens must be >= 0, not -1"):
        list(route.generate(prompt, -1))
    for bad, what in [(1.5, "1.5"), ("a", "'a'"), (True, "True"), (-5, "-5"), (2**40, "1099")]:
        with pytest.raises(ValueError, match=f"token 1 of the prompt is {what}"):
            list(route.generate([prompt[0], bad], 5))  # type: ignore[list-item]
    # 2**40 was protobuf's "Value out of range", a text its characters, 2.5 tokens a TypeError
    with pytest.raises(ValueError, match="the prompt is str: a list of token ids"):
        list(route.generate("hello", 5))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_tokens must be an integer, not 2\.5"):
        list(route.generate(prompt, 2.5))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token 0 of stop is 'x': token ids are integers"):
        list(route.generate(prompt, 5, stop={"x"}))  # type: ignore[arg-type]
    assert time.monotonic() - started < 1.0
    assert list(route.generate(prompt, 5)) == expected[:5]
    route.close()
    # a numpy prompt, as Chain takes one (it failed adding the generated tokens to it), and the
    # route as a context manager: closed on leaving the block
    with route_of(workers, LAYOUTS[3]) as route:
        assert list(route.generate(np.asarray(prompt, dtype=np.int64), 5)) == expected[:5]
    assert route not in OPEN_ROUTES
    with pytest.raises(ValueError, match="the route is closed: open another"):  # not gRPC's
        list(route.generate(prompt, 5))  # "Cannot invoke RPC: Channel closed!"


def test_route_open_names_a_bad_timeout_or_a_route_given_as_one_string(
    workers: dict[tuple[int, int], WorkerProcess],
) -> None:
    """-1, NaN and infinity went to gRPC as deadlines already past: every Describe failed
    DEADLINE_EXCEEDED; "a:1,b:2" as the addresses was taken character by character."""
    addresses = [workers[r].address for r in LAYOUTS[2]]
    for timeout in (-1, 0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
            Route.open(addresses, timeout=timeout)
    with pytest.raises(ValueError, match="is one string: give a list of HOST:PORT"):
        Route.open(",".join(addresses))  # type: ignore[arg-type]
    # these went on to the first generation, as protobuf's "Value out of range" or a worker's
    # INVALID_ARGUMENT
    with pytest.raises(ValueError, match=r"token_interval_ms must be an integer in \[0, 10000\]"):
        Route.open(addresses, token_interval_ms=-1)
    with pytest.raises(
        ValueError, match=re.escape("peer 1: address '127.0.0.1:99999' is not HOST:PORT")
    ):
        Route.open(addresses, peers=[addresses[0], "127.0.0.1:99999"])
    with pytest.raises(ValueError, match=r"draft max_draft must be an integer, not 2\.5"):
        Draft("lookup", max_draft=2.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["forward", "relay"])
def test_a_generation_ends_where_the_context_does(
    workers: dict[tuple[int, int], WorkerProcess], mode: str
) -> None:
    """The stages hold 512 tokens a session: a 500-token prompt leaves room for 12 fed back, so
    13 tokens come (the last is not fed back) and the generation ends as at max_tokens, with no
    capacity error; a prompt over the context is refused before a stage is asked."""
    route = route_of(workers, LAYOUTS[2], mode=mode)
    long = [1000 + (i * 7) % 5000 for i in range(500)]
    assert len(list(route.generate(long, 100))) == 13
    assert len(list(route.generate(long + long[:12], 100))) == 1  # 512: one token, none fed back
    with pytest.raises(
        ValueError, match="the prompt is 513 tokens, over the route's context of 512"
    ):
        list(route.generate(long + long[:13], 4))
    assert len(list(route.generate(long[:100], 5))) == 5  # and it goes on serving
    route.close()


def test_long_prompt_is_chunked(
    workers: dict[tuple[int, int], WorkerProcess], smollm2: Path, descriptor: list[str]
) -> None:
    small = [
        start_worker(smollm2, a, b, descriptor=descriptor, n_ctx=512, n_batch=16)
        for a, b in LAYOUTS[2]
    ]
    try:
        route = Route.open([w.address for w in small])
        assert min(s.describe.max_tokens_per_message for s in route.stages) == 16
        prompt = list(range(1000, 1050))
        chunked = list(route.generate(prompt, 4))
        whole = route_of(workers, LAYOUTS[2])
        assert len(chunked) == 4 and chunked[0] == next(iter(whole.generate(prompt, 1)))
    finally:
        for w in small:
            w.stop()


def test_forward_mode_keeps_prefill_chunks_in_order(
    smollm2: Path, descriptor: list[str], workers: dict[tuple[int, int], WorkerProcess]
) -> None:
    """The coordinator sends a long prompt's chunks back to back; forward mode gives what relay
    mode gives. (The head once let a second chunk overtake the first under load; that race showed
    in the route-change tests, about one run in four, not reliably here.)"""
    small = start_worker(smollm2, 0, 30, descriptor=descriptor, n_ctx=512, n_batch=16)
    try:
        forward = Route.open([small.address], timeout=30)
        relay = Route.open([small.address], timeout=30, mode="relay")
        for k in range(12):
            prompt = [1000 + (i * 7 + k) % 5000 for i in range(40)]  # chunks of 16, 16, 8
            assert list(forward.generate(prompt, 3)) == list(relay.generate(prompt, 3))
        forward.close()
        relay.close()
    finally:
        small.stop()


@pytest.mark.parametrize(
    "layout,stage,needle",
    [
        ([(0, 10), (20, 30)], 1, "leaves a gap"),
        ([(0, 20), (10, 30)], 1, "overlaps the stage before"),
        ([(0, 10), (10, 20)], 1, "route ends at layer 20, the model has 30"),
    ],
)
def test_route_ranges_are_checked(
    workers: dict[tuple[int, int], WorkerProcess],
    layout: list[tuple[int, int]],
    stage: int,
    needle: str,
) -> None:
    with pytest.raises(RouteError, match=needle) as info:
        route_of(workers, layout)
    assert info.value.stage == stage


def test_incompatible_descriptor_names_stage_and_field(
    workers: dict[tuple[int, int], WorkerProcess], smollm2: Path, descriptor: list[str]
) -> None:
    wrong = list(descriptor)
    wrong[wrong.index("--model-fingerprint") + 1] = "0" * 64
    other = start_worker(smollm2, 10, 30, descriptor=wrong, n_ctx=256)
    try:
        with pytest.raises(
            RouteError, match="incompatible descriptor field model_fingerprint"
        ) as info:
            Route.open([workers[(0, 10)].address, other.address])
        assert info.value.stage == 1
    finally:
        other.stop()


def wait_idle(address: str, within: float = 5.0) -> None:
    """Until the worker holds no session and no queued forward (streams wind down promptly)."""
    s = pb_grpc.ShardServiceStub(grpc.insecure_channel(address))
    deadline = time.monotonic() + within
    while True:
        health = s.Health(pb.HealthRequest(), timeout=10)
        if health.sessions == 0 and health.queue_depth == 0:
            return
        assert time.monotonic() < deadline, f"{address} still holds {health.sessions} sessions"
        time.sleep(0.05)


def stub(worker: WorkerProcess) -> pb_grpc.ShardServiceStub:
    return pb_grpc.ShardServiceStub(grpc.insecure_channel(worker.address))


def forward_once(worker: WorkerProcess, request: pb.ForwardRequest) -> pb.ForwardReply:
    replies = stub(worker).Forward(iter([request]), timeout=30)
    reply: pb.ForwardReply = next(replies)
    return reply


def boundary(n_tokens: int = 3) -> pb.Boundary:
    import numpy as np

    return encode(np.zeros((n_tokens, 576), dtype=np.float32), "f32")


def test_bad_messages_are_invalid_argument_and_the_worker_keeps_serving(
    workers: dict[tuple[int, int], WorkerProcess], reference: tuple[list[int], list[int]]
) -> None:
    middle = workers[(10, 20)]
    wrong_shape = boundary()
    wrong_shape.shape[2] = 512
    corrupt = boundary()
    corrupt.crc32 ^= 1
    truncated = boundary()
    truncated.payload = truncated.payload[:-8]
    flipped = boundary()  # a bit flipped in flight: the worker's CRC over the payload catches it
    payload = bytearray(flipped.payload)
    payload[1001] ^= 0x10
    flipped.payload = bytes(payload)
    cases = [
        (wrong_shape, "boundary.shape"),
        (corrupt, "boundary.crc32"),
        (flipped, "boundary.crc32"),
        (truncated, "boundary.payload"),
    ]
    for bad, needle in cases:
        request = pb.ForwardRequest(
            session_id=99, expect=pb.CacheExpectation(epoch=1), boundary=bad
        )
        with pytest.raises(grpc.RpcError) as info:
            forward_once(middle, request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in (info.value.details() or "")
    oversize = pb.ForwardRequest(session_id=98, boundary=pb.Boundary(payload=b"x" * (70 << 20)))
    with pytest.raises(grpc.RpcError) as info:
        forward_once(middle, oversize)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    prompt, expected = reference
    route = route_of(workers, LAYOUTS[3])
    assert list(route.generate(prompt, 8)) == expected[:8]


def test_stale_epoch_and_prefix_mismatch_are_failed_precondition(
    workers: dict[tuple[int, int], WorkerProcess],
) -> None:
    head = workers[(0, 10)]
    channel = grpc.insecure_channel(head.address)
    s = pb_grpc.ShardServiceStub(channel)

    open_streams = []  # a stream dropped by its client frees its sessions: keep them open

    def call(epoch: int, n_past: int, tokens: list[int], prefix: int = 0) -> pb.ForwardReply:
        request = pb.ForwardRequest(
            session_id=4242,
            token_ids=tokens,
            expect=pb.CacheExpectation(epoch=epoch, n_past=n_past, prefix_hash=prefix),
        )
        requests: queue.Queue[pb.ForwardRequest | None] = queue.Queue()
        requests.put(request)
        replies = s.Forward(iter(requests.get, None), timeout=30)
        open_streams.append((requests, replies))
        reply: pb.ForwardReply = next(replies)
        return reply

    first = call(2, 0, [1, 2, 3], FNV_OFFSET)
    assert first.n_past == 3
    for epoch, n_past, prefix, needle in [
        (1, 3, first.prefix_hash, "stale epoch"),
        (2, 3, 12345, "prefix hash differs"),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            call(epoch, n_past, [4], prefix)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert needle in (info.value.details() or "")
    assert call(2, 3, [4], first.prefix_hash).n_past == 4
    s.CloseSession(pb.CloseSessionRequest(session_id=4242))
    for requests, _ in open_streams:
        requests.put(None)


@pytest.mark.parametrize(
    "fault,timeout,within,code",
    [
        # a dead stage: its peer's link breaks and the stage before it names it
        ("kill", 10.0, 15.0, None),
        # a hung stage (its sockets stay open): the coordinator's per-token timeout, then the
        # Health probe names it
        ("stop", 4.0, 4 + 2 + 1, grpc.StatusCode.DEADLINE_EXCEEDED),
    ],
)
def test_a_worker_killed_or_hung_mid_generation_is_named(
    smollm2: Path,
    descriptor: list[str],
    reference: tuple[list[int], list[int]],
    fault: str,
    timeout: float,
    within: float,
    code: grpc.StatusCode | None,
) -> None:
    fleet = [start_worker(smollm2, a, b, descriptor=descriptor, n_ctx=512) for a, b in LAYOUTS[3]]
    try:
        route = Route.open([w.address for w in fleet], timeout=timeout)
        prompt, _ = reference
        stream = route.generate(prompt, 64)
        for _ in range(5):
            next(stream)
        if fault == "kill":
            fleet[1].kill()
        else:
            fleet[1].proc.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(RouteError) as info:
            for _ in stream:
                pass
        assert info.value.stage == 1 and fleet[1].address in str(info.value)
        assert code is None or info.value.code == code
        assert time.monotonic() - started < within
    finally:
        fleet[1].proc.send_signal(signal.SIGCONT)
        for w in fleet:
            w.stop()


def test_a_refusal_down_the_route_names_that_stage(
    smollm2: Path, descriptor: list[str], workers: dict[tuple[int, int], WorkerProcess]
) -> None:
    # the tail holds one session where the stages before it hold four: a second generation
    # while the first is open is refused there (the coordinator cannot know it beforehand)
    small_tail = start_worker(smollm2, 20, 30, descriptor=descriptor, n_ctx=512, max_sessions=1)
    try:
        addresses = [workers[(0, 10)].address, workers[(10, 20)].address, small_tail.address]
        route = Route.open(addresses, timeout=30)
        first = route.generate(list(range(1000, 1010)), 64)
        next(first)
        with pytest.raises(RouteError) as info:
            list(route.generate(list(range(2000, 2010)), 4))
        assert info.value.stage == 2 and info.value.address == small_tail.address
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "all 1 session slots are in use" in info.value.what
        first.close()
        route.close()
        for address in addresses:
            wait_idle(address)
    finally:
        small_tail.stop()


def test_health_describe_and_drain(smollm2: Path, descriptor: list[str], tmp_path: Path) -> None:
    # started outside any checkout: the build identity it reports is compiled into it
    worker = start_worker(
        smollm2, 10, 20, descriptor=descriptor, n_ctx=256, max_sessions=3, cwd=tmp_path
    )
    channel = grpc.insecure_channel(worker.address)
    check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    s = pb_grpc.ShardServiceStub(channel)
    health = s.Health(pb.HealthRequest(), timeout=10)
    assert health.ready and health.capacity == 3 and not health.draining
    d = s.Describe(pb.DescribeRequest(), timeout=10)
    assert (d.layer_first, d.layer_last, d.boundary.n_embd, d.boundary.hc) == (10, 20, 576, 1)
    assert d.compatibility.model_fingerprint == descriptor[1]
    repo = find_root()
    assert d.compatibility.llama_cpp_commit == llama_pin(repo.llama_manifest)["commit"]
    assert d.compatibility.patch_stack_sha256 == patch_stack_hash(repo.patches)
    assert (d.compatibility.lane, d.compatibility.schema_version) == ("cpu", 1)
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(30) == 0
    assert "DGR-WORKER-STOPPED" in (worker.proc.stdout.read() if worker.proc.stdout else "")


def test_cli_generate_streams_through_a_route(
    workers: dict[tuple[int, int], WorkerProcess],
) -> None:
    route = ",".join(workers[r].address for r in LAYOUTS[2])
    done = subprocess.run(
        ["dgr", "generate", "--route", route, "--max-tokens", "12", "The capital of France is"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "Paris" in done.stdout
    assert "tok/s) through 2 stages" in done.stderr
    empty = subprocess.run(
        ["dgr", "generate", "--route", route, ""], capture_output=True, text=True, timeout=60
    )
    assert empty.returncode == 2, empty
    assert "error: the prompt is empty: it encodes to no tokens" in empty.stderr
    # a prompt a few tokens short of the 512-token context: the generation ends there, and says so
    full = subprocess.run(
        ["dgr", "generate", "--route", route, "--max-tokens", "64", " cat" * 505],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert full.returncode == 0, full
    assert "; stopped at the route's context of 512 tokens" in full.stderr, full.stderr
    assert "stopped at" not in done.stderr


def test_cli_says_a_route_of_bare_workers_is_not_checked_for_one_model(smollm2: Path) -> None:
    """Route.open compares every stage's model fingerprint with the head's; workers started
    without one (bare dgr-shard-worker) all report "" and so agree whatever they load: the CLI
    says that check did not happen."""
    bare = start_worker(smollm2, 0, 30, descriptor=[], n_ctx=64, threads=1)
    try:
        done = subprocess.run(
            ["dgr", "generate", "--route", bare.address, "--max-tokens", "2", "hi"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        bare.stop()
    assert done.returncode == 0, done
    assert "note: the route's workers report no model fingerprint" in done.stderr
    assert "tok/s) through 1 stage\n" in done.stderr, done.stderr


def test_cli_refuses_a_local_tokenizer_of_another_model(
    workers: dict[tuple[int, int], WorkerProcess], smollm2: Path, quick_twin: Path
) -> None:
    """--model names the GGUF whose vocabulary tokenizes the prompt: another model's would
    tokenize every prompt wrong without a word, so it is refused by fingerprint."""
    route = ",".join(workers[r].address for r in LAYOUTS[2])
    other = subprocess.run(
        ["dgr", "generate", "--route", route, "--model", str(quick_twin), "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert other.returncode == 1, other
    assert f"error: --model {quick_twin} is not the route's model" in other.stderr
    missing = subprocess.run(
        ["dgr", "generate", "--route", route, "--model", "/nonexistent.gguf", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 1 and "Traceback" not in missing.stderr, missing
    assert "error: --model: /nonexistent.gguf: file does not exist" in missing.stderr
    same = subprocess.run(
        ["dgr", "generate", "--route", route, "--model", str(smollm2), "--max-tokens", "4", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert same.returncode == 0, same


def test_an_abandoned_stream_frees_its_session(
    workers: dict[tuple[int, int], WorkerProcess],
) -> None:
    head = workers[(0, 10)]
    s = pb_grpc.ShardServiceStub(grpc.insecure_channel(head.address))
    before = s.Health(pb.HealthRequest(), timeout=10).sessions

    def requests() -> Iterator[pb.ForwardRequest]:
        yield pb.ForwardRequest(
            session_id=777,
            token_ids=[1, 2, 3],
            expect=pb.CacheExpectation(epoch=1, prefix_hash=FNV_OFFSET),
        )
        time.sleep(5)  # the client stalls past its deadline

    replies = s.Forward(requests(), timeout=1.0)
    next(replies)
    assert s.Health(pb.HealthRequest(), timeout=10).sessions == before + 1
    with pytest.raises(grpc.RpcError) as info:
        next(replies)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 10
    while s.Health(pb.HealthRequest(), timeout=10).sessions != before:
        assert time.monotonic() < deadline, "the worker should free the abandoned session"
        time.sleep(0.1)


def sessions_freed(
    workers: dict[tuple[int, int], WorkerProcess], layout: list[tuple[int, int]]
) -> None:
    """Every stage of `layout` holds no session within 10 s."""
    for r in layout:
        deadline = time.monotonic() + 10
        while workers[r].sessions() != 0:
            assert time.monotonic() < deadline, f"stage {r} kept the session"
            time.sleep(0.1)


@pytest.mark.parametrize("mode", ["forward", "relay"])
def test_a_process_that_leaves_a_route_open_mid_generation_exits(
    workers: dict[tuple[int, int], WorkerProcess], mode: str
) -> None:
    """Neither closing the route nor finishing the generator: the generator ends at interpreter
    exit, where gRPC's timers no longer run, so the session's close must not wait on a call's
    deadline alone (relay mode waited forever there)."""
    import sys

    addresses = [workers[r].address for r in LAYOUTS[2]]
    program = (
        "import sys\n"
        "from dgr_route.route import Route\n"
        f"route = Route.open({addresses!r}, timeout=30, mode={mode!r})\n"
        "tokens = route.generate(list(range(1000, 1012)), 8)\n"
        "next(tokens)\n"
        "print('left open', flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "left open\n"
    sessions_freed(workers, LAYOUTS[2])  # the stages freed the session it left


@pytest.mark.parametrize("mode", ["forward", "relay"])
def test_closing_a_route_ends_its_generations_and_frees_their_sessions(
    workers: dict[tuple[int, int], WorkerProcess], mode: str
) -> None:
    route = route_of(workers, LAYOUTS[2], mode=mode)
    tokens = route.generate(list(range(1000, 1012)), 8)
    next(tokens)
    assert [workers[r].sessions() for r in LAYOUTS[2]] == [1, 1]
    route.close()
    assert list(tokens) == []  # ended: nothing more comes, and no error either
    sessions_freed(workers, LAYOUTS[2])
