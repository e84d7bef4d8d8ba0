"""The coordinator: open a route over shard workers, prefill and decode through it.

A route is an ordered list of stages whose layer ranges must be contiguous and cover
[0, n_layer) exactly, with identical compatibility descriptors; a mismatch names the stage and
the field. Two modes (docs/architecture.md has the hop counts):

- forward (the default): the coordinator sends the prompt to the head over one Forward stream;
  each stage streams its boundary straight to the next, the tail returns each sampled token to
  the head, and the head decodes on and streams the tokens back. The coordinator is off the
  per-token path; a failure anywhere comes back as a StageError naming the stage.
- relay: the coordinator holds a stream per stage and carries each boundary from a stage to the
  next itself, for workers that cannot reach each other.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import numbers
import queue
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import numpy as np
from dgr.v1 import shard_pb2 as pb
from dgr.v1 import shard_pb2_grpc as pb_grpc
from dgr_wire.codec import BY_NAME, FNV_OFFSET, chunks, decode_logits, prefix_hash
from dgr_wire.ranges import LayerRange

from dgr_route.prefixes import PrefixIndex
from dgr_route.security import PLAIN, Security

# what every stage of a route must agree on. The lane is not among them: stages of one route may
# compute on different backends (a GPU machine beside CPU ones), as the boundary is the same
# bytes whatever computed it; each stage reports its lane (Route.lanes) and a lane's numerics
# are what its certification records vouch for.
COMPAT_FIELDS = (
    "model_fingerprint",
    "llama_cpp_commit",
    "patch_stack_sha256",
    "schema_version",
    "arch",
    "n_layer",
    "recipe",
)


MODES = ("forward", "relay")
# Generated tokens replayed after a route change go in batches of at most this many tokens. The
# original run decoded them one at a time; with the engine's batch-invariant kernels (the
# default) any batch gives the same bits, but with ggml's stock ones (worker --kernels stock) a
# batch of up to 62 tokens does and 64 do not (batch shape selects other kernels), so larger
# batches could change the continuation. test_replay_batches_equal_decode_steps pins both.
REPLAY_BATCH = 32
# forward mode: the head streams tokens at most this often, the ones between in one reply; every
# reply wakes this process, and its threads would take CPU from a stage computing on the same
# host. 25 ms is below what a reader of a stream notices; the first token and the last go at once.
TOKEN_INTERVAL_MS = 25
# how long the end of a relay generation waits for a stage to free the session (CloseSession)
CLOSE_TIMEOUT = 2.0
STATUS_BY_CODE = {code.value[0]: code for code in grpc.StatusCode}


class RouteError(RuntimeError):
    """A route could not be opened or a stage failed; names the stage and what was wrong."""

    def __init__(
        self, stage: int, address: str, what: str, code: grpc.StatusCode | None = None
    ) -> None:
        self.stage, self.address, self.what, self.code = stage, address, what, code
        super().__init__(f"stage {stage} ({address}): {what}")


@dataclass
class Stage:
    index: int
    address: str
    channel: grpc.Channel
    stub: pb_grpc.ShardServiceStub
    describe: pb.DescribeReply
    metadata: tuple[tuple[str, str], ...] = ()  # per-call credentials (bearer token)

    @property
    def layers(self) -> LayerRange:
        return LayerRange(first=self.describe.layer_first, last=self.describe.layer_last)

    @property
    def expectation(self) -> pb.StageExpectation:
        """What this stage served when the route opened: every request expects it, so that a
        worker restarted behind the address with another range or model refuses."""
        d = self.describe
        return pb.StageExpectation(
            layer_first=d.layer_first,
            layer_last=d.layer_last,
            model_fingerprint=d.compatibility.model_fingerprint,
        )


FLOAT32_MAX = 3.4028234663852886e38


def is_integer(value: object) -> bool:
    """An int or a numpy integer, not a bool: what the wire's integer fields take."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or a float (numpy's included), not a bool: what the wire's float fields take."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int = 0
    want_logits: bool = False  # the tail returns each step's logits with the token

    def __post_init__(self) -> None:
        """The wire's ranges (float32, uint32, uint64), checked where the caller made the value:
        a bad one is a ValueError naming it, before any stage is asked (the tail checks again)."""
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        checks = (
            ("temperature", t, is_number(t) and 0 <= t <= FLOAT32_MAX, "a finite number >= 0"),
            ("top_k", k, is_integer(k) and 0 <= k < 2**32, "an integer in [0, 2**32)"),
            ("top_p", p, is_number(p) and 0 <= p <= 1, "a number in [0, 1]"),
            ("seed", s, is_integer(s) and 0 <= s < 2**64, "an integer in [0, 2**64)"),
        )
        for name, value, ok, what in checks:
            if not ok:  # NaN fails every comparison; a float seed or top_k is not an integer
                raise ValueError(f"sampling {name} must be {what}, not {value!r}")

    def message(self) -> pb.Sampling:
        return pb.Sampling(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            want_logits=self.want_logits,
        )


DRAFT_SOURCES = {
    "off": pb.DRAFT_SOURCE_UNSPECIFIED,
    "lookup": pb.DRAFT_SOURCE_LOOKUP,
    "mtp": pb.DRAFT_SOURCE_MTP,
}
MAX_DRAFT = 16  # the workers' bound (native/worker/validate.h kMaxDraft)
MAX_TOKEN_INTERVAL_MS = 10000  # the workers' bound (native/worker/validate.cpp kMaxTokenIntervalMs)


@dataclass
class Draft:
    """Speculative decoding (forward mode): up to `max_draft` drafted tokens a step, from prompt
    lookup at the head (n-grams of `ngram_min`..`ngram_max` tokens) or from the tail's MTP block
    (`mtp`: a tail started with --mtp drafts with each token it returns); one forward of them
    crosses the route, the tail verifies. The output equals plain decode; the head adapts the
    length to the measured acceptance and step time and stops drafting where it does not pay."""

    source: str = "off"
    max_draft: int = 8
    ngram_min: int = 2
    ngram_max: int = 4

    def __post_init__(self) -> None:
        if self.source not in DRAFT_SOURCES:
            raise ValueError(f"draft {self.source!r} is not one of {', '.join(DRAFT_SOURCES)}")
        for name in ("max_draft", "ngram_min", "ngram_max"):
            value = getattr(self, name)
            if not is_integer(value):
                raise ValueError(f"draft {name} must be an integer, not {value!r}")
        if not 1 <= self.max_draft <= MAX_DRAFT:
            raise ValueError(f"max_draft {self.max_draft} outside [1, {MAX_DRAFT}]")
        if not 1 <= self.ngram_min <= self.ngram_max <= 8:
            raise ValueError(
                f"n-gram lengths {self.ngram_min}..{self.ngram_max}: need 1 <= min <= max <= 8"
            )

    @property
    def on(self) -> bool:
        return self.source != "off"

    def message(self) -> pb.Draft:
        if not self.on:
            return pb.Draft()
        if self.source == "mtp":  # no n-grams; the head tells the tail how many to propose
            return pb.Draft(source=pb.DRAFT_SOURCE_MTP, max_draft=self.max_draft)
        return pb.Draft(
            source=DRAFT_SOURCES[self.source],
            max_draft=self.max_draft,
            ngram_min=self.ngram_min,
            ngram_max=self.ngram_max,
        )


@dataclass
class DraftUsage:
    """What one generation did: drafts verified, drafts accepted and the verified steps (route
    trips) that produced the tokens (speculative decoding), and the prompt tokens the stages
    did not compute because they kept them from an earlier generation (prefix reuse)."""

    drafted: int = 0
    accepted: int = 0
    replies: int = 0
    cached_tokens: int = 0


class _Stream:
    """One Forward stream: requests go in through a queue, replies come back in order.

    The stream itself has no deadline (a session may generate for as long as it likes); each
    reply must come within `timeout` seconds of its request, or the stage is named as stuck.
    """

    def __init__(self, stage: Stage, timeout: float) -> None:
        self.stage = stage
        self.timeout = timeout
        self.requests: queue.Queue[pb.ForwardRequest | None] = queue.Queue()
        self.call_ = stage.stub.Forward(iter(self.requests.get, None), metadata=stage.metadata)
        self.replies: queue.Queue[pb.ForwardReply | BaseException | None] = queue.Queue()
        self.ended = False  # the stream's end (or failure) was taken from `replies`
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for reply in self.call_:
                self.replies.put(reply)
            self.replies.put(None)
        except BaseException as exc:
            self.replies.put(exc)

    def call(self, request: pb.ForwardRequest) -> pb.ForwardReply:
        self.requests.put(request)
        return self.receive()

    def send(self, request: pb.ForwardRequest) -> None:
        self.requests.put(request)

    def receive(self, stuck: Callable[[], RouteError] | None = None) -> pb.ForwardReply:
        """The next reply; past the timeout, `stuck` names the stage to blame (else this one)."""
        try:
            reply = self.replies.get(timeout=self.timeout)
        except queue.Empty:
            self.call_.cancel()
            if stuck is not None:
                raise stuck() from None
            raise RouteError(
                self.stage.index,
                self.stage.address,
                f"no reply within {self.timeout:g} s",
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ) from None
        if reply is None or isinstance(reply, BaseException):
            self.ended = True
        if isinstance(reply, grpc.RpcError):
            raise RouteError(
                self.stage.index,
                self.stage.address,
                f"{reply.code().name}: {reply.details()}",
                reply.code(),
            ) from reply
        if isinstance(reply, BaseException):
            raise reply
        if reply is None:
            raise RouteError(
                self.stage.index, self.stage.address, "the stream ended without a reply"
            )
        return reply

    def close(self) -> None:
        self.requests.put(None)

    def wait_ended(self, timeout: float) -> None:
        """After close(): until the stage ends the stream (replies still in flight are dropped),
        or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while not self.ended and (left := deadline - time.monotonic()) > 0:
            try:
                item = self.replies.get(timeout=left)
            except queue.Empty:
                break
            if item is None or isinstance(item, BaseException):
                return
        self.call_.cancel()


@dataclass
class SeamTraffic:
    """What crossed the seams into stages after the head: serialized boundary messages and the
    token ids that ride along (the sideband hash-routed layers read; every stage checks them
    against its prefix hash). Counted per token per seam."""

    token_seams: int = 0
    boundary_bytes: int = 0
    sideband_bytes: int = 0

    def add(self, n_tokens: int, boundary_bytes: int, sideband_bytes: int) -> None:
        self.token_seams += n_tokens
        self.boundary_bytes += boundary_bytes
        self.sideband_bytes += sideband_bytes

    def per_token(self) -> dict[str, float]:
        n = max(self.token_seams, 1)
        return {"boundary": self.boundary_bytes / n, "sideband": self.sideband_bytes / n}


@dataclass(eq=False)  # a route is itself (OPEN_ROUTES), not its fields
class Route:
    stages: list[Stage]
    timeout: float = 60.0
    wire_dtype: str = "f32"  # the residual's dtype on the wire: f32 (bitwise parity), f16, bf16
    mode: str = "forward"
    # forward mode: the stages' addresses as the stages reach each other (default: as the
    # coordinator reaches them)
    peers: list[str] = field(default_factory=list)
    token_interval_ms: int = TOKEN_INTERVAL_MS  # forward mode (0: every token in its own reply)
    draft: Draft = field(default_factory=Draft)  # forward mode: speculative decoding
    # forward mode: start a generation from the longest history an earlier one left on the
    # stages (prefixes.py); False: every generation prefills from n_past 0
    prefix_reuse: bool = True
    prefixes: PrefixIndex = field(init=False, default_factory=PrefixIndex)
    n_layer: int = field(init=False)
    wire: SeamTraffic = field(init=False)  # relay mode: what crossed the seams through here
    # generations not yet ended (close ends them)
    live: weakref.WeakSet[Generator[pb.TokenResult, None, None]] = field(
        init=False, default_factory=weakref.WeakSet
    )
    closed: bool = field(init=False, default=False)  # close() ran: no generation starts

    def __post_init__(self) -> None:
        check_wire_dtype(self.wire_dtype)
        check_mode(self.mode)
        interval = self.token_interval_ms
        if not (is_integer(interval) and 0 <= interval <= MAX_TOKEN_INTERVAL_MS):
            raise ValueError(
                f"token_interval_ms must be an integer in [0, {MAX_TOKEN_INTERVAL_MS}], "
                f"not {interval!r}"
            )
        if not self.peers:
            self.peers = [s.address for s in self.stages]
        if len(self.peers) != len(self.stages):
            raise ValueError(f"{len(self.peers)} peer addresses for {len(self.stages)} stages")
        check_addresses(self.peers, "peer")
        check_draft(self.draft, self.mode)
        self.n_layer = self.stages[0].describe.compatibility.n_layer
        self.wire = SeamTraffic()
        OPEN_ROUTES.add(self)

    @property
    def n_ctx(self) -> int:
        """Tokens a session may hold on this route: the least of its stages' contexts."""
        return min(s.describe.n_ctx for s in self.stages)

    @property
    def slots(self) -> int:
        """Sessions this route holds at once: the least of its stages' session slots."""
        return min(s.describe.max_sessions for s in self.stages)

    @property
    def reuses(self) -> bool:
        """Whether generations start from what earlier ones left: asked for (prefix_reuse), every
        stage keeps finished sessions (Describe), and no drafting (prompt lookup drafts from
        the prefill's tokens, and the tail's MTP block follows a session from its first token)."""
        return (
            self.prefix_reuse
            and not self.draft.on
            and all(s.describe.prefix_cache_sessions > 0 for s in self.stages)
        )

    @property
    def lanes(self) -> list[str]:
        """The backend each stage computes on, as its worker reports it (they may differ)."""
        return [s.describe.compatibility.lane for s in self.stages]

    @classmethod
    def open(
        cls,
        addresses: list[str],
        timeout: float = 60.0,
        wire_dtype: str = "f32",
        security: Security = PLAIN,
        mode: str = "forward",
        peers: list[str] | None = None,
        token_interval_ms: int = TOKEN_INTERVAL_MS,
        draft: Draft | None = None,
        prefix_reuse: bool = True,
    ) -> Route:
        check_addresses(addresses)  # before connecting to anything
        check_timeout(timeout)
        check_wire_dtype(wire_dtype)
        check_mode(mode)
        draft = draft or Draft()
        check_draft(draft, mode)
        stages: list[Stage] = []
        try:
            for i, address in enumerate(addresses):
                if (why := security.cleartext_refusal(address)) is not None:
                    raise RouteError(i, address, why, grpc.StatusCode.FAILED_PRECONDITION)
                channel = security.channel(address)
                stub = pb_grpc.ShardServiceStub(channel)  # type: ignore[no-untyped-call]
                try:
                    describe = stub.Describe(
                        pb.DescribeRequest(), timeout=timeout, metadata=security.metadata
                    )
                except grpc.RpcError as exc:
                    channel.close()
                    what = f"Describe failed: {exc.code().name}: {exc.details()}"
                    raise RouteError(i, address, what, exc.code()) from exc
                stages.append(Stage(i, address, channel, stub, describe, security.metadata))
            check_route(stages)
            if draft.on:
                draft = fit_draft(draft, stages)
            for stage in stages[1:]:
                if BY_NAME.get(wire_dtype) not in stage.describe.boundary.dtypes:
                    raise RouteError(
                        stage.index, stage.address, f"does not accept a {wire_dtype} boundary"
                    )
            return cls(
                stages,
                timeout,
                wire_dtype,
                mode,
                list(peers or []),
                token_interval_ms,
                draft,
                prefix_reuse,
            )
        except BaseException:
            for stage in stages:  # the stages that answered: their channels and threads go
                stage.channel.close()
            raise

    def __enter__(self) -> Route:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """End the route's generations still open (each frees its session on the stages, as it
        does when it runs out), then its channels. A generation running in another thread at
        that moment is left to end on its own: its next call fails on the closed channel."""
        for generation in list(self.live):
            # "generator already executing": it is mid-step in another thread
            with contextlib.suppress(ValueError):
                generation.close()
        for stage in self.stages:
            stage.channel.close()
        self.closed = True
        OPEN_ROUTES.discard(self)

    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        sampling: Sampling | None = None,
        stop: set[int] | None = None,
    ) -> Generator[int, None, None]:
        """Yield generated token ids; prefill travels in chunks the stages accept."""
        for result in self.results(prompt, max_tokens, sampling, stop):
            yield int(result.token_id)

    def trace(
        self, prompt: list[int], max_tokens: int, usage: DraftUsage | None = None
    ) -> Iterator[tuple[int, np.ndarray]]:
        """Greedy generation yielding (token, the tail's f32 logits it was chosen from)."""
        for result in self.results(prompt, max_tokens, Sampling(want_logits=True), usage=usage):
            yield int(result.token_id), decode_logits(result.logits)

    def results(
        self,
        prompt: list[int],
        max_tokens: int,
        sampling: Sampling | None = None,
        stop: set[int] | None = None,
        usage: DraftUsage | None = None,
    ) -> Generator[pb.TokenResult, None, None]:
        """The tail's result for every generated token (id, logprob, logits when asked);
        `usage`, when given, counts what speculative decoding did."""
        yield from self.run(
            secrets.randbits(63), 1, prompt, max_tokens, sampling, stop, usage=usage
        )

    def run(
        self,
        session: int,
        epoch: int,
        history: list[int],
        max_tokens: int,
        sampling: Sampling | None = None,
        stop: set[int] | None = None,
        prompt_len: int | None = None,
        usage: DraftUsage | None = None,
    ) -> Generator[pb.TokenResult, None, None]:
        """Prefill `history` (the prompt, or everything so far when a session moves to this
        route under a new epoch: then `prompt_len` says where its generated tokens start, see
        prefill_plan) from n_past 0, then decode; each result is the next token. The session's
        caches on these stages are closed when the generator ends, or when the route closes.
        An empty history or a negative max_tokens is a ValueError, raised here (no stage could
        answer a prefill of nothing: the coordinator would wait for a token that never comes), and
        so is a history longer than the route's context. A generation ends where the context does,
        as at max_tokens: the history and every token fed back fill it (the last token sampled is
        not fed back), instead of failing there with the stages' capacity error."""
        if self.closed:  # as a closed file: the channels are gone ("Channel closed!")
            raise ValueError("the route is closed: open another")
        history = token_ids(history)  # a list, or an array of token ids
        if len(history) == 0:
            raise ValueError("the prompt is empty: a generation starts from at least one token")
        if not is_integer(max_tokens):
            raise ValueError(f"max_tokens must be an integer, not {max_tokens!r}")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, not {max_tokens}")
        if stop is not None:
            stop = set(token_ids(stop, "stop"))
        n_ctx = self.n_ctx
        if len(history) > n_ctx:
            raise ValueError(
                f"the prompt is {len(history)} tokens, over the route's context of {n_ctx}"
            )
        max_tokens = min(max_tokens, n_ctx - len(history) + 1)
        generation = self._generation(
            session, epoch, history, max_tokens, sampling, stop, prompt_len, usage
        )
        self.live.add(generation)
        return generation

    def _generation(
        self,
        session: int,
        epoch: int,
        history: list[int],
        max_tokens: int,
        sampling: Sampling | None,
        stop: set[int] | None,
        prompt_len: int | None,
        usage: DraftUsage | None,
    ) -> Generator[pb.TokenResult, None, None]:
        sampling = sampling or Sampling()
        chunk = min(s.describe.max_tokens_per_message for s in self.stages)
        plan = prefill_plan(len(history), chunk, prompt_len)
        if self.mode == "forward":
            usage = usage or DraftUsage()
            reuse = self.prefixes.take(history) if self.reuses and max_tokens > 0 else 0
            if reuse:
                # the rest in the shapes a full prefill gives it (the prompt's rest in chunks, the
                # generated tokens in replay batches)
                rest = prefill_plan(
                    len(history) - reuse,
                    chunk,
                    None if prompt_len is None else max(prompt_len - reuse, 0),
                )
                reused = self._run_forward(
                    session,
                    epoch,
                    history,
                    [slice(p.start + reuse, p.stop + reuse) for p in rest],
                    max_tokens,
                    sampling,
                    stop,
                    usage,
                    reuse,
                )
                try:
                    first = next(reused, None)
                except RouteError as err:
                    # a stage no longer holds the prefix (evicted, restarted): nothing was taken;
                    # prefill from n_past 0, under a session id of its own so that no stage can
                    # still be ending the refused one under this id
                    if err.code != grpc.StatusCode.FAILED_PRECONDITION:
                        raise
                    session = secrets.randbits(63)
                else:
                    if first is not None:
                        yield first
                        yield from reused
                    return
            yield from self._run_forward(
                session, epoch, history, plan, max_tokens, sampling, stop, usage
            )
            return
        streams = [_Stream(s, self.timeout) for s in self.stages]
        n_past, prefix = 0, FNV_OFFSET
        try:
            token = pb.TokenResult()
            for part in plan:
                tokens = history[part]
                token = self._step(streams, session, epoch, tokens, n_past, prefix, sampling)
                prefix = prefix_hash(tokens, prefix)
                n_past += len(tokens)
            for i in range(max_tokens):
                yield token
                if (stop and token.token_id in stop) or i == max_tokens - 1:
                    return  # no step past the last token: its result would be thrown away
                ids = [int(token.token_id)]
                new = self._step(streams, session, epoch, ids, n_past, prefix, sampling)
                prefix = prefix_hash(ids, prefix)
                n_past += 1
                token = new
        finally:
            for stream in streams:
                stream.close()
            # in parallel and briefly: a dead or hung stage must not delay the error
            closing = [
                stage.stub.CloseSession.future(
                    pb.CloseSessionRequest(session_id=session),
                    timeout=CLOSE_TIMEOUT,
                    metadata=stage.metadata,
                )
                for stage in self.stages
            ]
            for future in closing:
                settled(future)  # a dead stage has no session left to close

    def _run_forward(
        self,
        session: int,
        epoch: int,
        history: list[int],
        parts: list[slice],
        max_tokens: int,
        sampling: Sampling,
        stop: set[int] | None,
        usage: DraftUsage,
        reuse: int = 0,
    ) -> Generator[pb.TokenResult, None, None]:
        """`reuse` > 0: the stages start from the first `reuse` tokens of `history`, kept from an
        earlier generation, and `parts` cover the rest."""
        if max_tokens < 1:
            return
        head = _Stream(self.stages[0], self.timeout)
        spec = pb.RouteSpec(
            stages=self.peers, stage_index=0, expect=[s.expectation for s in self.stages]
        )
        n_past, prefix = reuse, prefix_hash(history[:reuse]) if reuse else FNV_OFFSET
        generated: list[int] = []
        held = 0  # tokens of history + generated the stages' KV holds, as the last reply says
        try:
            for k, part in enumerate(parts):
                tokens = history[part]
                last = k == len(parts) - 1
                head.send(
                    pb.ForwardRequest(
                        session_id=session,
                        expect=pb.CacheExpectation(
                            epoch=epoch,
                            n_past=n_past,
                            prefix_hash=prefix,
                            reuse=reuse > 0 and k == 0,
                        ),
                        token_ids=tokens,
                        sampling=sampling.message(),
                        boundary_dtype=f"DTYPE_{self.wire_dtype.upper()}",
                        route=spec,
                        stage=spec.expect[0],
                        chunk_index=k,
                        last_chunk=last,
                        max_tokens=max_tokens if last else 0,
                        stop_ids=sorted(stop or ()),
                        token_interval_ms=self.token_interval_ms,
                        # MTP: on every chunk (the tail's MTP block follows each forward)
                        draft=self.draft.message() if last or self.draft.source == "mtp" else None,
                    )
                )
                prefix = prefix_hash(tokens, prefix)
                n_past += len(tokens)
            while True:
                reply = head.receive(self._stuck)
                if reply.HasField("error"):
                    e = reply.error
                    raise RouteError(e.stage, e.address, e.message, STATUS_BY_CODE.get(e.code))
                if not reply.HasField("token"):
                    raise RouteError(
                        0, self.stages[0].address, "the head sent a reply without a token"
                    )
                if not generated:
                    usage.cached_tokens = reuse
                usage.drafted += reply.drafted
                usage.accepted += reply.accepted
                usage.replies += 1
                held = reply.n_past
                for token in (reply.token, *reply.more_tokens):
                    generated.append(int(token.token_id))
                    yield token
                    if (stop and token.token_id in stop) or len(generated) == max_tokens:
                        return
        finally:
            # the head stops decoding and ends its stream once every stage after it has ended
            # its own and freed the session (kept for prefix reuse): when this returns, the
            # route computes nothing for it
            head.close()
            head.wait_ended(min(self.timeout, 5.0))
            if self.reuses and held:
                # what the stages keep: the history and the tokens fed back (all but the last)
                self.prefixes.put((history + generated)[:held])

    def _stuck(self) -> RouteError:
        """No token within the timeout: name the first stage that does not answer Health."""
        probe = min(2.0, max(self.timeout / 4, 0.2))
        checks = [
            s.stub.Health.future(pb.HealthRequest(), timeout=probe, metadata=s.metadata)
            for s in self.stages
        ]
        for stage, check in zip(self.stages, checks, strict=True):
            if not settled(check, probe):
                return RouteError(
                    stage.index,
                    stage.address,
                    f"no token within {self.timeout:g} s and no answer to Health in {probe:g} s",
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                )
        return RouteError(
            0,
            self.stages[0].address,
            f"no token within {self.timeout:g} s (every stage answers Health)",
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )

    def _step(
        self,
        streams: list[_Stream],
        session: int,
        epoch: int,
        tokens: list[int],
        n_past: int,
        prefix: int,
        sampling: Sampling,
    ) -> pb.TokenResult:
        expect = pb.CacheExpectation(epoch=epoch, n_past=n_past, prefix_hash=prefix)
        boundary: pb.Boundary | None = None
        for stream in streams:
            request = pb.ForwardRequest(
                boundary_dtype=f"DTYPE_{self.wire_dtype.upper()}",
                session_id=session,
                expect=expect,
                token_ids=tokens,
                sampling=sampling.message(),
                last_chunk=True,
                stage=stream.stage.expectation,
            )
            if boundary is not None:
                request.boundary.CopyFrom(boundary)
                self.wire.add(len(tokens), boundary.ByteSize(), 4 * len(tokens))
            reply = stream.call(request)
            if reply.HasField("token"):
                return reply.token
            boundary = reply.boundary
        raise RouteError(len(streams) - 1, streams[-1].stage.address, "the tail sent no token")


# routes not closed yet: closed at interpreter exit, while gRPC still runs (atexit comes before
# the interpreter stops its daemon threads). Left to the garbage collection of the interpreter's
# end instead, a generation's close could wait forever on a lock held by a stopped gRPC thread.
OPEN_ROUTES: weakref.WeakSet[Route] = weakref.WeakSet()


@atexit.register
def _close_open_routes() -> None:
    for route in list(OPEN_ROUTES):
        route.close()


def settled(future: grpc.Future[Any], within: float = CLOSE_TIMEOUT) -> bool:
    """Whether a unary call's future ended without an error, waiting at most `within` seconds
    (and a little more) of this thread's own clock: the call's deadline alone is no bound when
    nothing runs gRPC's timers any more, as at interpreter exit, where an unfinished generator
    of an unclosed route ends (a forever-wait there hung the process). One not done is cancelled."""
    try:
        future.result(timeout=within + 0.5)
    except grpc.FutureTimeoutError:
        future.cancel()
        return False
    except (grpc.RpcError, grpc.FutureCancelledError):
        return False
    return True


def prefill_plan(n_history: int, chunk: int, prompt_len: int | None = None) -> list[slice]:
    """How a history is prefilled: the prompt in chunks of `chunk` tokens (as the first run did),
    then the tokens generated after it, when a session re-prefills them, in batches of at most
    REPLAY_BATCH, which the lane computes bit for bit like the decode steps that made them."""
    if prompt_len is None or prompt_len >= n_history:
        return chunks(n_history, chunk)
    replay = chunks(n_history - prompt_len, min(chunk, REPLAY_BATCH))
    return chunks(prompt_len, chunk) + [
        slice(s.start + prompt_len, s.stop + prompt_len) for s in replay
    ]


def fit_draft(draft: Draft, stages: list[Stage]) -> Draft:
    """`draft` with max_draft within what every stage can roll back (Describe.max_rollback: a
    step may reject every draft); a stage that cannot roll back at all refuses drafting."""
    for stage in stages:
        if stage.describe.max_rollback == 0:
            raise RouteError(
                stage.index,
                stage.address,
                "cannot drop rejected drafts (its state is not positional and it keeps no "
                "snapshots: start it with --rollback N)",
            )
    tail = stages[-1]
    if draft.source == "mtp" and not tail.describe.mtp:
        raise RouteError(
            tail.index,
            tail.address,
            "does not serve the MTP block that MTP drafts come from (start the tail with --mtp)",
        )
    limit = min(s.describe.max_rollback for s in stages)
    return replace(draft, max_draft=min(draft.max_draft, limit))


def token_ids(values: Iterable[Any], what: str = "the prompt") -> list[int]:
    """`values` as a list of ints (numpy integers included), or ValueError naming the first that
    is not an integer in the wire's [0, 2**31): a float or a string would otherwise fail deep in
    the wire codec, and 2**40 as protobuf's "Value out of range"."""
    if isinstance(values, (str, bytes)):
        raise ValueError(f"{what} is {type(values).__name__}: a list of token ids (integers)")
    ids: list[int] = []
    for i, value in enumerate(values):
        if not is_integer(value):
            raise ValueError(f"token {i} of {what} is {value!r}: token ids are integers")
        token = int(value)
        if not 0 <= token < 2**31:
            raise ValueError(f"token {i} of {what} is {token}: token ids are in [0, 2**31)")
        ids.append(token)
    return ids


def check_addresses(addresses: list[str], what: str = "stage") -> None:
    """A route is one or more stages, each HOST:PORT (a [v6] host in brackets) with a port in
    1..65535, or unix:PATH. gRPC takes a port past 65535 modulo 2**16 and a bare name as
    port 443: either would dial somewhere the caller did not name."""
    if isinstance(addresses, str):  # its characters would be taken for the stages
        raise ValueError(
            f"the route {addresses!r} is one string: give a list of HOST:PORT, one per stage "
            "(a comma-separated route split at its commas)"
        )
    if not addresses:
        raise ValueError("a route needs at least one stage address (HOST:PORT)")
    for i, address in enumerate(addresses):
        if address.startswith("unix:") and len(address) > len("unix:"):
            continue
        host, _, port = address.rpartition(":")
        if not host.strip("[]") or not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(
                f"{what} {i}: address {address!r} is not HOST:PORT with a port in 1..65535"
            )


def check_timeout(timeout: float) -> None:
    """A stage's deadline per step: a finite number of seconds > 0 (gRPC took -1, NaN and
    infinity as a deadline already past, and every Describe failed DEADLINE_EXCEEDED)."""
    if not (is_number(timeout) and 0 < timeout < math.inf):
        raise ValueError(f"timeout must be a finite number of seconds > 0, not {timeout!r}")


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"route mode {mode!r} is not one of {', '.join(MODES)}")


def check_draft(draft: Draft, mode: str) -> None:
    if draft.on and mode != "forward":
        raise ValueError("speculative decoding (draft) needs forward mode: the head drafts")


def check_wire_dtype(name: str) -> None:
    if name not in BY_NAME:
        raise ValueError(f"wire dtype {name!r} is not one of {', '.join(BY_NAME)}")


def check_route(stages: list[Stage]) -> None:
    first = stages[0]
    n_layer = first.describe.compatibility.n_layer
    for stage in stages:
        for name in COMPAT_FIELDS:
            want = getattr(first.describe.compatibility, name)
            got = getattr(stage.describe.compatibility, name)
            if got != want:
                raise RouteError(
                    stage.index,
                    stage.address,
                    f"incompatible descriptor field {name}: {got!r}, stage 0 has {want!r}",
                )
    expected = 0
    for stage in stages:
        try:
            lo, hi = stage.layers.first, stage.layers.last
        except ValueError as exc:  # the worker's Describe, validated as a LayerRange
            raise RouteError(stage.index, stage.address, f"invalid layer range: {exc}") from exc
        if lo != expected:
            what = "leaves a gap" if lo > expected else "overlaps the stage before"
            raise RouteError(
                stage.index,
                stage.address,
                f"layer range [{lo}, {hi}) {what}: expected it to start at {expected}",
            )
        expected = hi
    if expected != n_layer:
        last = stages[-1]
        raise RouteError(
            last.index, last.address, f"route ends at layer {expected}, the model has {n_layer}"
        )
