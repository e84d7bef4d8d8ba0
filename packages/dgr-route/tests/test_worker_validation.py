"""Every field that reaches a real dgr-shard-worker is validated, and a refused request leaves
nothing behind: no queue slot, no session slot, no cache. Regression tests for the defects where
one request disabled a worker for good (top_k cast to int32, a leaked in-flight counter) or held a
session slot after a refusal, and for a NaN boundary that was accepted."""

from __future__ import annotations

import math
import queue
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from dgr.v1 import shard_pb2 as pb
from dgr.v1 import shard_pb2_grpc as pb_grpc
from dgr_cli.workers import WorkerProcess, descriptor_args, start_worker
from dgr_wire.codec import FNV_OFFSET, decode_logits, encode, prefix_hash

# FNV-1a 64 over little-endian int32 ids: the cache expectation every stage and the coordinator
# compute (native/worker/wire.cpp and dgr_wire.codec.prefix_hash must both give these)
PREFIX_VECTORS = [
    ([], 0xCBF29CE484222325),
    ([1, 2, 3], 0xFD1F0F4381EB0395),
    ([49151, 0, 1000, 7], 0xCE458719C83A1389),
]


@pytest.fixture(scope="module")
def fleet(smollm2: Path) -> Iterator[dict[str, WorkerProcess]]:
    descriptor = descriptor_args(smollm2)
    started = {
        "whole": start_worker(smollm2, 0, 30, descriptor=descriptor, n_ctx=256, max_sessions=2),
        "tail": start_worker(smollm2, 20, 30, descriptor=descriptor, n_ctx=256, max_sessions=2),
    }
    yield started
    for w in started.values():
        w.stop()


def stub(worker: WorkerProcess) -> pb_grpc.ShardServiceStub:
    return pb_grpc.ShardServiceStub(grpc.insecure_channel(worker.address))


def forward(worker: WorkerProcess, request: pb.ForwardRequest) -> pb.ForwardReply:
    """One request on a stream read to its end: the call ends normally, and a session the request
    opened stays open until CloseSession (an abandoned stream would free it)."""
    [reply] = list(stub(worker).Forward(iter([request]), timeout=30))
    return reply


def health(worker: WorkerProcess) -> pb.HealthReply:
    reply: pb.HealthReply = stub(worker).Health(pb.HealthRequest(), timeout=10)
    return reply


def refusal(worker: WorkerProcess, request: pb.ForwardRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        forward(worker, request)
    return info.value


def tokens_request(session: int, tokens: list[int], **sampling: float) -> pb.ForwardRequest:
    return pb.ForwardRequest(
        session_id=session,
        token_ids=tokens,
        expect=pb.CacheExpectation(epoch=1, prefix_hash=FNV_OFFSET),
        sampling=pb.Sampling(**sampling),
    )


@pytest.mark.parametrize(
    "sampling,needle",
    [
        ({"temperature": 1.0, "top_k": 2**32 - 1}, "sampling.top_k"),
        ({"temperature": 1.0, "top_k": 49153}, "sampling.top_k"),
        ({"temperature": math.nan}, "sampling.temperature"),
        ({"temperature": -0.5}, "sampling.temperature"),
        ({"temperature": math.inf}, "sampling.temperature"),
        ({"temperature": 1.0, "top_p": 1.5}, "sampling.top_p"),
        ({"temperature": 1.0, "top_p": math.nan}, "sampling.top_p"),
        ({"temperature": 1.0, "top_p": -0.1}, "sampling.top_p"),
    ],
)
def test_bad_sampling_is_invalid_argument(
    fleet: dict[str, WorkerProcess], sampling: dict[str, float], needle: str
) -> None:
    err = refusal(fleet["whole"], tokens_request(501, [1, 2, 3], **sampling))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (err.details() or "")


def test_refused_requests_release_the_queue_and_the_worker_keeps_serving(
    fleet: dict[str, WorkerProcess],
) -> None:
    whole = fleet["whole"]
    for _ in range(20):  # more than --max-queue (16): a leaked counter would lock the worker
        refusal(whole, tokens_request(502, [1, 2, 3], temperature=1.0, top_k=2**32 - 1))
    assert health(whole).queue_depth == 0
    ok = forward(whole, tokens_request(503, [1, 2, 3], temperature=1.0, top_k=40, top_p=0.9))
    assert 0 <= ok.token.token_id < 49152 and ok.token.logprob <= 0.0
    stub(whole).CloseSession(pb.CloseSessionRequest(session_id=503), timeout=10)


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0.0}, {"temperature": 0.8, "top_k": 40, "seed": 7}]
)
def test_the_tail_reports_its_pick_and_its_log_softmax(
    fleet: dict[str, WorkerProcess], sampling: dict[str, float]
) -> None:
    """The token and logprob the tail sends against the logits it sends beside them: greedy is the
    first largest logit (what llama.cpp's greedy sampler picks; the tail finds it without the
    sampler chain's candidate array), a sampled token comes from the top 40, and either logprob is
    the log-softmax of the raw logits (the tail's vectorized log-sum-exp, cloned per ISA)."""
    whole = fleet["whole"]
    prompt = [1, 4093, 314, 2496, 28]
    reply = forward(whole, tokens_request(507, prompt, want_logits=True, **sampling))
    stub(whole).CloseSession(pb.CloseSessionRequest(session_id=507), timeout=10)
    logits = decode_logits(reply.token.logits).astype(np.float64).reshape(-1)
    assert logits.shape == (49152,)
    log_softmax = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    token = reply.token.token_id
    if sampling["temperature"] == 0.0:
        assert token == int(np.argmax(logits))
    else:
        assert token in set(np.argsort(-logits)[:40].tolist())
    assert reply.token.logprob == pytest.approx(log_softmax[token], abs=1e-5)


def test_a_request_beyond_n_ctx_holds_no_session_slot(fleet: dict[str, WorkerProcess]) -> None:
    whole = fleet["whole"]
    before = health(whole).sessions
    err = refusal(whole, tokens_request(504, list(range(1000, 1300))))  # 300 tokens, n_ctx 256
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "n_ctx" in (err.details() or "")
    assert health(whole).sessions == before


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_a_non_finite_boundary_is_invalid_argument(
    fleet: dict[str, WorkerProcess], bad: float, dtype: str
) -> None:
    values = np.zeros((2, 576), dtype=np.float32)
    values[1, 17] = bad
    request = pb.ForwardRequest(
        session_id=505, expect=pb.CacheExpectation(epoch=1), boundary=encode(values, dtype)
    )
    err = refusal(fleet["tail"], request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not finite" in (err.details() or "") and "token 1" in (err.details() or "")
    assert health(fleet["tail"]).sessions == 0


@pytest.mark.parametrize("tokens,expected", PREFIX_VECTORS)
def test_the_prefix_hash_is_one_function_in_both_languages(
    fleet: dict[str, WorkerProcess], tokens: list[int], expected: int
) -> None:
    assert prefix_hash(tokens, FNV_OFFSET) == expected
    if tokens:
        reply = forward(fleet["whole"], tokens_request(506, tokens))
        assert reply.prefix_hash == expected
        stub(fleet["whole"]).CloseSession(pb.CloseSessionRequest(session_id=506), timeout=10)


def test_forward_mode_checks_the_route(fleet: dict[str, WorkerProcess]) -> None:
    whole, tail = fleet["whole"], fleet["tail"]
    route = pb.RouteSpec(stages=[whole.address, tail.address], stage_index=0)
    request = tokens_request(507, [1, 2, 3])
    request.route.CopyFrom(route)
    request.last_chunk, request.max_tokens = True, 2
    err = refusal(whole, request)  # the whole model is head and tail: index 0 of 2 is wrong
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "route.stage_index" in (err.details() or "") and "the tail" in (err.details() or "")
    request.route.CopyFrom(pb.RouteSpec(stages=[whole.address], stage_index=3))
    assert "route.stage_index" in (refusal(whole, request).details() or "")
    assert health(whole).sessions == 0


def test_bad_reuse_requests_are_refused_and_take_nothing(fleet: dict[str, WorkerProcess]) -> None:
    """CacheExpectation.reuse: a relay request (no route), no prefix (n_past 0 or no hash) is
    INVALID_ARGUMENT; a prefix the worker never kept is FAILED_PRECONDITION naming it; none of
    them holds a session slot or counts a kept session."""
    whole = fleet["whole"]
    spec = pb.RouteSpec(stages=[whole.address], stage_index=0)
    ids = [1, 2, 3]

    sessions = iter(range(611, 700))

    def reuse(n_past: int, hash_: int, route: bool = True) -> pb.ForwardRequest:
        request = tokens_request(next(sessions), ids)
        request.expect.CopyFrom(
            pb.CacheExpectation(epoch=1, n_past=n_past, prefix_hash=hash_, reuse=True)
        )
        if route:
            request.route.CopyFrom(spec)
        request.last_chunk, request.max_tokens = True, 2
        return request

    def first_reply(request: pb.ForwardRequest) -> pb.ForwardReply:
        """Forward mode answers a refused request with a StageError reply on the open stream."""
        requests: queue.Queue[pb.ForwardRequest | None] = queue.Queue()
        requests.put(request)
        call = stub(whole).Forward(iter(requests.get, None), timeout=30)
        reply: pb.ForwardReply = next(call)
        requests.put(None)
        call.cancel()
        return reply

    err = refusal(whole, reuse(5, prefix_hash([7] * 5), route=False))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "forward-mode field" in (err.details() or "")
    for request, code, needle in [
        (reuse(0, FNV_OFFSET), grpc.StatusCode.INVALID_ARGUMENT, "expect.reuse"),
        (reuse(5, 0), grpc.StatusCode.INVALID_ARGUMENT, "expect.reuse"),
        (
            reuse(5, prefix_hash([7] * 5)),
            grpc.StatusCode.FAILED_PRECONDITION,
            "no kept session starts with these 5 tokens",
        ),
    ]:
        reply = first_reply(request)
        assert reply.error.code == code.value[0] and needle in reply.error.message, reply.error
    deadline = time.monotonic() + 5  # the cancelled streams end
    while health(whole).sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    h = health(whole)
    assert h.sessions == 0 and h.cached_sessions == 0


def test_loop_takes_tokens_only_for_sessions_the_head_drives(
    fleet: dict[str, WorkerProcess],
) -> None:
    tokens = iter([pb.ForwardReply(session_id=508, epoch=1, token=pb.TokenResult(token_id=5))])
    with pytest.raises(grpc.RpcError) as info:
        stub(fleet["whole"]).Loop(tokens, timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no forward-mode session 508" in (info.value.details() or "")


def test_health_answers_while_the_engine_computes(fleet: dict[str, WorkerProcess]) -> None:
    import threading

    whole = fleet["whole"]
    requests: queue.Queue[pb.ForwardRequest | None] = queue.Queue()
    replies = stub(whole).Forward(iter(requests.get, None), timeout=60)
    for n in range(8):  # eight 200-token prefills keep the engine busy for a while
        requests.put(
            pb.ForwardRequest(
                session_id=600 + n,
                token_ids=list(range(2000, 2200)),
                expect=pb.CacheExpectation(epoch=1, prefix_hash=FNV_OFFSET),
            )
        )
    done = threading.Event()
    latencies: list[float] = []

    def probe() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            health(whole)
            latencies.append(time.perf_counter() - t0)

    t = threading.Thread(target=probe)
    t.start()
    for _ in range(2):  # max_sessions 2: the rest are refused, which ends the stream
        next(replies)
    done.set()
    t.join()
    requests.put(None)
    for n in range(2):
        stub(whole).CloseSession(pb.CloseSessionRequest(session_id=600 + n), timeout=10)
    assert latencies and max(latencies) < 0.2


def test_a_worker_computes_only_in_a_free_host_slot(smollm2: Path, tmp_path: Path) -> None:
    """Workers of one host take turns through flock'd slot files (cores / threads of them):
    while this test holds every slot, a forward waits; once they are free it completes. Held
    past the bound, the forward computes anyway."""
    import fcntl
    import os
    import threading

    slots = tmp_path / "slots"
    worker = start_worker(
        smollm2, 0, 30, threads=1, n_ctx=256, extra=["--compute-slots", str(slots)]
    )
    try:
        files = sorted(slots.glob("slot-*"))
        assert len(files) == max(1, os.cpu_count() or 1)  # cores / 1 thread
        held = [os.open(f, os.O_RDWR) for f in files]
        for fd in held:
            fcntl.flock(fd, fcntl.LOCK_EX)
        replies: list[pb.ForwardReply] = []
        t = threading.Thread(
            target=lambda: replies.append(forward(worker, tokens_request(700, [1, 2, 3])))
        )
        t.start()
        time.sleep(1.5)
        assert not replies and health(worker).queue_depth == 1  # waiting for a slot
        for fd in held:
            os.close(fd)  # closing releases the lock
        t.join(30)
        assert len(replies) == 1 and replies[0].n_past == 3
        # a holder that hangs (here: never lets go) holds the others up for 2 s at most
        held = [os.open(f, os.O_RDWR) for f in files]
        for fd in held:
            fcntl.flock(fd, fcntl.LOCK_EX)
        t0 = time.monotonic()
        reply = forward(worker, tokens_request(701, [1, 2, 3]))
        assert reply.n_past == 3 and 1.9 < time.monotonic() - t0 < 10
        for fd in held:
            os.close(fd)
    finally:
        worker.stop()


def head_replies(
    worker: WorkerProcess, request: pb.ForwardRequest, n_tokens: int
) -> list[pb.ForwardReply]:
    """A forward-mode generation on a 1-stage route, read reply by reply until `n_tokens` tokens
    came, then closed as the coordinator closes it."""
    requests: queue.Queue[pb.ForwardRequest | None] = queue.Queue()
    requests.put(request)
    stream = stub(worker).Forward(iter(requests.get, None), timeout=60)
    replies: list[pb.ForwardReply] = []
    while sum(1 + len(r.more_tokens) for r in replies) < n_tokens:
        replies.append(next(stream))
    requests.put(None)
    assert list(stream) == []
    return replies


def test_the_head_coalesces_the_tokens_it_streams(fleet: dict[str, WorkerProcess]) -> None:
    """token_interval_ms: the first token goes at once, the rest gather until the interval has
    passed, the last goes at once; the tokens are the ones a reply per token carries."""
    whole = fleet["whole"]
    prompt = [1000 + (i * 7) % 5000 for i in range(40)]

    def generation(
        session: int, interval: int, stop: list[int], n: int = 24
    ) -> list[pb.ForwardReply]:
        request = tokens_request(session, prompt)
        request.route.CopyFrom(pb.RouteSpec(stages=[whole.address], stage_index=0))
        request.last_chunk, request.max_tokens = True, 24
        request.token_interval_ms = interval
        request.stop_ids.extend(stop)
        return head_replies(whole, request, n)

    each = generation(509, 0, [])
    assert [len(r.more_tokens) for r in each] == [0] * 24
    tokens = [r.token.token_id for r in each]
    gathered = generation(510, 10_000, [])  # 24 tokens take well under 10 s
    assert len(gathered) == 2 and len(gathered[0].more_tokens) == 0
    assert [gathered[0].token.token_id, gathered[1].token.token_id] + [
        t.token_id for t in gathered[1].more_tokens
    ] == tokens
    assert gathered[1].n_past == each[-1].n_past and gathered[1].prefix_hash == each[-1].prefix_hash
    # a stop id ends the generation: its token goes at once, not after the interval
    stop = tokens[5]
    stopped = generation(511, 10_000, [stop], tokens.index(stop) + 1)
    got = [stopped[0].token.token_id]
    for r in stopped[1:]:
        got += [r.token.token_id] + [t.token_id for t in r.more_tokens]
    assert got == tokens[: tokens.index(stop) + 1] and len(stopped) == 2
    deadline = time.monotonic() + 10
    while health(whole).sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert health(whole).sessions == 0
    request = tokens_request(512, prompt)
    request.token_interval_ms = 10_001
    err = refusal(whole, request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_interval_ms" in (
        err.details() or ""
    )


def test_a_cohort_is_checked(fleet: dict[str, WorkerProcess]) -> None:
    """Cohort (forward mode, a decode step's batch-mates at the stage before) is validated like
    every other field: no id 0, a size in [2, max_sessions], never on a relay-mode request."""
    whole = fleet["whole"]  # max_sessions 2
    relayed = tokens_request(513, [1, 2, 3])
    relayed.cohort.id, relayed.cohort.size = 9, 2
    err = refusal(whole, relayed)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cohort: a forward-mode field" in (err.details() or "")
    bad = ((0, 2, "cohort.id"), (9, 1, "cohort.size"), (9, 3, "cohort.size"))
    for cohort_id, size, words in bad:
        request = tokens_request(514, [1, 2, 3])
        request.route.CopyFrom(pb.RouteSpec(stages=[whole.address], stage_index=0))
        request.last_chunk, request.max_tokens = True, 2
        request.cohort.id, request.cohort.size = cohort_id, size
        # forward mode: the head's failure is the stream's last reply, naming the stage
        replies: list[pb.ForwardReply] = []
        with pytest.raises(grpc.RpcError):
            replies.extend(stub(whole).Forward(iter([request]), timeout=30))
        error = replies[-1].error
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and words in error.message, (
            cohort_id,
            size,
            error,
        )
    assert "outside [2, 2]" in error.message
    assert health(whole).sessions == 0 and health(whole).queue_depth == 0
