"""An OpenAI-compatible HTTP front for a route: /v1/models, /v1/completions,
/v1/chat/completions (the model's own chat template) and /health, with SSE streaming.

It behaves as llama-server and vLLM's OpenAI server do where a client can tell:
- errors are OpenAI error objects (`{"error": {"message", "type", "param", "code"}}`) with the
  status OpenAI uses: 400 for a bad request (an unknown argument, a prompt longer than the
  context), 404 `model_not_found`, 429 with Retry-After when the admission queue or the route's
  session slots are full, 502/503 when a stage fails;
- `max_tokens` is capped by the room the context leaves, and the generation then ends "length";
- stop strings are matched across tokens and never sent, text is detokenized incrementally
  (dgr_route.text), and `finish_reason` says "stop" when a stop string or end-of-generation
  token ended it;
- a stream that fails after it started ends with an error event and `[DONE]`, never a cut
  connection; a failure before the first token is an HTTP error;
- logprobs and top_logprobs come from the tail (its logprob of the sampled token, its logits
  for the alternatives).

Each request is one route session, served from the event loop (dgr_serve.admission): at most
`max_active` requests run at once and `max_queue` more wait, on the loop and holding no thread,
so /health and new requests are answered whatever waits; beyond that, 429. The synchronous
route is read a piece at a time in worker threads, and a client that goes away has its
generation closed (its stage sessions freed, its slot passed on) within a second. GET /metrics
is Prometheus text: time to first token and per output token, tokens, requests (metrics.py).

A request whose prompt starts with what an earlier one left on the stages (a chat's next turn)
prefills only the rest (prefix reuse, dgr_route.prefixes), bit for bit what a full prefill
gives, and `usage.prompt_tokens_details.cached_tokens` says how many tokens it did not compute.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Generator
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc
import numpy as np
from dgr.v1 import shard_pb2 as pb
from dgr_route.route import DraftUsage, Route, RouteError, Sampling
from dgr_route.text import Detokenizer, StopMatcher, stop_list
from dgr_route.tokenizer import TokenizerError, TokenizerLike
from dgr_wire.codec import decode_logits
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from dgr_serve.admission import Admission, Bridge, Full
from dgr_serve.metrics import ServeMetrics

RETRY_AFTER_S = 1
MAX_TOP_LOGPROBS = 20


class OpenAIError(Exception):
    """An error the client gets as an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status == 429 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def body_limit(n_ctx: int) -> int:
    """The most request bytes taken: a prompt holds at most n_ctx tokens, and a token's text
    (JSON-escaped) stays well within 256 bytes; 1 MiB at least. Without it a 200 MB body was
    read whole and reached the head's tokenizer, whose gRPC limit answered it as a 500."""
    return max(1 << 20, 256 * n_ctx)


class BoundedBody:
    """ASGI middleware: a body past `limit` bytes is a 413 OpenAI error object, by its
    Content-Length before a byte is read, else (chunked) once the bytes read pass the limit
    (an HTTPException, which FastAPI's body parsing passes on to the app's handler).
    FastAPI's own max_body_size answers the first case in plain text, over the app's handlers."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            refused = OpenAIError(413, self.over(f"{int(length)} bytes"), code="request_too_large")
            await refused.response()(scope, receive, send)
            return
        seen = 0

        async def bounded() -> Any:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, self.over(f"more than {self.limit} bytes"))
            return message

        await self.app(scope, bounded, send)

    def over(self, size: str) -> str:
        return f"the request body is {size}: this server takes {self.limit} at most"


def busy(what: str) -> OpenAIError:
    return OpenAIError(
        429,
        f"{what}; retry after {RETRY_AFTER_S} s",
        "rate_limit_error",
        None,
        "rate_limit_exceeded",
    )


def from_route_error(exc: RouteError) -> OpenAIError:
    if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if "n_ctx" in exc.what:
            return OpenAIError(400, str(exc), param="max_tokens", code="context_length_exceeded")
        return busy(f"the route is full ({exc})")
    status = 504 if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED else 502
    return OpenAIError(status, f"route failed: {exc}", "server_error", None, "route_failed")


# --- requests --------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Request(BaseModel):
    """Fields both endpoints take. Unknown arguments are refused, as OpenAI does, rather than
    silently ignored; known ones this server cannot honour are refused unless left at their
    defaults. Numbers must be finite: NaN and infinities are refused by name."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, lt=2**32)  # an extension, as llama-server and vLLM take it
    seed: int | None = None
    user: str | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    def check(self) -> None:
        refused = [
            ("n", self.n != 1, "one choice per request: n must be 1"),
            ("presence_penalty", self.presence_penalty != 0, "penalties are not supported"),
            ("frequency_penalty", self.frequency_penalty != 0, "penalties are not supported"),
            ("logit_bias", bool(self.logit_bias), "logit_bias is not supported"),
        ]
        for param, bad, why in refused:
            if bad:
                raise OpenAIError(400, why, param=param, code="unsupported_value")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options needs stream: true", param="stream_options")
        try:
            stop_list(self.stop)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="stop") from exc


# a JSON value's kind by the Python type it parses to, for messages about a body
JSON_KINDS = {
    "list": "array",
    "str": "string",
    "int": "number",
    "float": "number",
    "bool": "boolean",
    "NoneType": "null",
}


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def one_prompt(cls, value: Any) -> Any:
        # named here: pydantic's own message for the union names its str branch instead
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(
                f"prompt is {type(value).__name__}: a string, a list of one string, or a list of "
                "token ids"
            )
        if value and isinstance(value[0], list):
            raise ValueError("one prompt per request: a list of token-id lists is a batch")
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, (str, int)):
                raise ValueError(
                    f"prompt item {i} is {type(item).__name__}: a prompt's list holds one "
                    "string or token ids (integers)"
                )
        if len({type(item) for item in value}) > 1:
            raise ValueError("prompt mixes strings and token ids: one string, or token ids")
        return value

    def check(self) -> None:
        super().check()
        if self.echo:
            raise OpenAIError(400, "echo is not supported", param="echo", code="unsupported_value")
        if self.suffix:
            raise OpenAIError(400, "suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise OpenAIError(400, "best_of must be 1", param="best_of")
        if (
            isinstance(self.prompt, list)
            and self.prompt
            and isinstance(self.prompt[0], str)
            and len(self.prompt) != 1
        ):
            raise OpenAIError(400, "one prompt per request", param="prompt")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def text_parts_only(cls, value: Any) -> Any:
        # named here: pydantic's own message for the union names its str branch instead
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(f"content is {type(value).__name__}: a string or a list of parts")
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"content part {i} is {kind!r}: only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i}: a text part needs its text as a string")
            if extra := sorted(set(part) - {"type", "text"}):
                raise ValueError(f"content part {i}: unrecognized field(s) {', '.join(extra)}")
        return value

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.tools or self.tool_choice not in (None, "none"):
            raise OpenAIError(400, "tool calls are not supported", param="tools")
        if self.response_format not in (None, {"type": "text"}):
            raise OpenAIError(
                400, "only the text response format is supported", param="response_format"
            )
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")


# --- generation ------------------------------------------------------------------------------


@dataclass
class TokenInfo:
    token: int
    piece: bytes
    logprob: float
    top: list[tuple[int, bytes, float]]  # the tail's most likely tokens, best first


@dataclass
class Piece:
    """Text ready to go out, the tokens consumed since the last piece, and why it ended."""

    text: str
    tokens: list[TokenInfo] = field(default_factory=list)
    finish: str | None = None


@dataclass
class Generation:
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stops: list[str]
    top_logprobs: int  # alternatives per token; 0 none
    want_logprobs: bool
    completion_tokens: int = 0
    # what the route did: speculative decoding (--draft) and prefix reuse
    drafts: DraftUsage = field(default_factory=DraftUsage)

    def usage(self) -> dict[str, Any]:
        p, c = len(self.prompt), self.completion_tokens
        d = self.drafts
        return {
            "prompt_tokens": p,
            "completion_tokens": c,
            "total_tokens": p + c,
            # prompt tokens the stages kept from an earlier request (prefix reuse), as OpenAI
            # reports its prompt caching
            "prompt_tokens_details": {"cached_tokens": d.cached_tokens},
            # OpenAI's fields for predicted tokens: drafts the route verified and kept or not
            "completion_tokens_details": {
                "accepted_prediction_tokens": d.accepted,
                "rejected_prediction_tokens": d.drafted - d.accepted,
            },
        }


def create_app(
    route: Route,
    tokenizer: TokenizerLike,
    model_name: str,
    max_active: int | None = None,
    max_queue: int = 16,
) -> FastAPI:
    n_ctx = route.n_ctx
    app = FastAPI(title="DGR", description="OpenAI-compatible API over a DGR route")
    app.add_middleware(BoundedBody, limit=body_limit(n_ctx))
    admission = Admission(route.slots if max_active is None else max_active, max_queue)
    app.state.admission = admission  # what it admits, for whoever serves the app to say
    metrics = ServeMetrics(lambda: admission.running, lambda: admission.waiting)

    @app.exception_handler(OpenAIError)
    def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        elif first.get("type") == "json_invalid":
            param = None  # its loc is a character offset, not a field
            message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
        elif not loc:  # the body itself: valid JSON, but an array, a string or a number
            kind = type(first.get("input")).__name__
            message = f"the request body is a JSON {JSON_KINDS.get(kind, kind)}, not an object"
        else:
            what = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
            message = f"{param}: {what}" if param else str(exc)
        return OpenAIError(400, message, param=param).response()

    @app.exception_handler(Exception)
    def unexpected(_: Request, exc: Exception) -> JSONResponse:
        # a defect of this server, not the client's: still an OpenAI error object (the traceback
        # goes to the server's log)
        what = f"internal error: {type(exc).__name__}: {exc}"
        return OpenAIError(500, what, "server_error", code="internal_error").response()

    @app.exception_handler(HTTPException)
    def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        what = f"{request.method} {request.url.path}: {exc.detail}"
        return OpenAIError(exc.status_code, what, code=code).response()

    def encode(text: str, param: str) -> list[int]:
        """The text's tokens; a text the head's tokenizer takes no message of (past its gRPC
        limit) is the client's 400, not this server's 500."""
        try:
            return tokenizer.encode(text)
        except TokenizerError as exc:
            if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            raise OpenAIError(
                400, f"{param}: {len(text)} characters, too long to tokenize ({exc})", param=param
            ) from exc

    def check_model(name: str | None) -> None:
        if name not in (None, "", model_name):
            raise OpenAIError(
                404,
                f"The model `{name}` does not exist; this server serves `{model_name}`",
                param="model",
                code="model_not_found",
            )

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "owned_by": "dgr", "created": 0}

    def plan(
        req: _Request, prompt: list[int], max_tokens: int | None, top: int, want: bool, param: str
    ) -> Generation:
        """Checks common to both endpoints; max_tokens capped by the room the context leaves."""
        req.check()
        check_model(req.model)
        if not prompt:
            raise OpenAIError(400, "the prompt is empty", param=param)
        # token ids given as such: the client's error, named here, before a stage refuses them
        n_vocab = tokenizer.n_vocab
        outside = next(((i, t) for i, t in enumerate(prompt) if not 0 <= t < n_vocab), None)
        if outside is not None:
            raise OpenAIError(
                400,
                f"token id {outside[1]} (position {outside[0]}) is outside the vocabulary of "
                f"{n_vocab} tokens",
                param=param,
                code="invalid_value",
            )
        room = n_ctx - len(prompt)
        if room < 1:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {n_ctx} tokens. However, your "
                f"prompt has {len(prompt)} tokens, which leaves no room for a completion.",
                param=param,
                code="context_length_exceeded",
            )
        seed = req.seed if req.seed is not None else uuid.uuid4().int & (2**63 - 1)
        sampling = Sampling(
            temperature=req.temperature if req.top_p > 0 else 0.0,  # top_p 0 keeps one token
            top_k=req.top_k,
            top_p=req.top_p if req.top_p < 1.0 else 0.0,
            seed=seed & (2**64 - 1),
            want_logits=top > 0,
        )
        return Generation(
            prompt=prompt,
            max_tokens=min(max_tokens or room, room),
            sampling=sampling,
            stops=stop_list(req.stop),
            top_logprobs=top,
            want_logprobs=want,
        )

    def pieces(gen: Generation) -> Generator[Piece, None, None]:
        """The generation as text pieces; the last one carries finish_reason. A RouteError
        raised here is the route's failure."""
        detok = Detokenizer(tokenizer.detokenize)
        matcher = StopMatcher(gen.stops)
        pending: list[TokenInfo] = []
        results = route.results(
            gen.prompt, gen.max_tokens, gen.sampling, set(tokenizer.eog_ids), usage=gen.drafts
        )
        finish = "length"
        with contextlib.closing(results):
            for result in results:
                gen.completion_tokens += 1
                token = int(result.token_id)
                if tokenizer.is_eog(token):
                    finish = "stop"
                    break
                if gen.want_logprobs:
                    pending.append(token_info(token, result, gen.top_logprobs))
                text, hit = matcher.feed(detok.feed(token))
                if hit:
                    yield Piece(text, pending, "stop")
                    return
                if text:
                    yield Piece(text, pending)
                    pending = []
        text, hit = matcher.feed(detok.flush())  # a held partial character, then the held tail
        yield Piece(text + matcher.flush(), pending, "stop" if hit else finish)

    def token_info(token: int, result: pb.TokenResult, top: int) -> TokenInfo:
        alternatives: list[tuple[int, bytes, float]] = []
        if top:
            logits = decode_logits(result.logits).astype(np.float64)
            shifted = logits - logits.max()
            logp = shifted - np.log(np.exp(shifted).sum())
            best = np.argpartition(-logp, top)[:top]
            best = best[np.argsort(-logp[best], kind="stable")]
            alternatives = [(int(t), tokenizer.detokenize([int(t)]), float(logp[t])) for t in best]
        return TokenInfo(token, tokenizer.detokenize([token]), float(result.logprob), alternatives)

    async def admitted(gen: Generation, request: Request) -> Bridge:
        """pieces() inside an admission slot, read from the event loop, the first piece
        (prefill, the first token) already computed: a failure that early is an HTTP error, not
        a stream that starts and breaks. The slot and the stage sessions go when the response
        ends, fails or its client leaves."""
        arrived = time.perf_counter()
        try:
            await admission.acquire()
        except Full as exc:
            raise busy(f"{exc}, the most this server admits") from exc

        def closed() -> None:
            admission.release()
            metrics.finished(
                arrived,
                bridge.first_at,
                bridge.last_at,
                len(gen.prompt),
                gen.drafts.cached_tokens,
                gen.completion_tokens,
            )

        bridge = Bridge(pieces(gen), closed, request.is_disconnected)
        try:
            await bridge.start()
        except RouteError as exc:
            raise from_route_error(exc) from exc
        return bridge

    async def sse(
        events: AsyncIterator[dict[str, Any]], final: dict[str, Any] | None = None
    ) -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except RouteError as exc:
            yield f"data: {json.dumps(from_route_error(exc).body())}\n\n"
        else:
            if final is not None:
                yield f"data: {json.dumps(final)}\n\n"
        yield "data: [DONE]\n\n"

    async def stage_health(stage: Any) -> pb.HealthReply:
        """A stage's Health, awaited on the loop (the call runs on gRPC's own threads)."""
        call = stage.stub.Health.future(pb.HealthRequest(), timeout=2.0, metadata=stage.metadata)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def settle() -> None:
            if not done.done():
                done.set_result(None)

        def wake(_: Any) -> None:
            loop.call_soon_threadsafe(settle)

        call.add_done_callback(wake)
        await done
        return call.result()  # type: ignore[no-any-return]

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/health")
    async def health() -> JSONResponse:
        stages = []
        replies = await asyncio.gather(
            *(stage_health(s) for s in route.stages), return_exceptions=True
        )
        for stage, h in zip(route.stages, replies, strict=True):
            if isinstance(h, grpc.RpcError):
                exc = h
                return OpenAIError(
                    503,
                    f"stage {stage.index} ({stage.address}) does not answer Health: "
                    f"{exc.code().name}",
                    "server_error",
                    code="stage_unavailable",
                ).response()
            if isinstance(h, BaseException):
                raise h
            stages.append(
                {
                    "address": stage.address,
                    "layers": [stage.layers.first, stage.layers.last],
                    "sessions": h.sessions,
                    "ready": h.ready,
                }
            )
        return JSONResponse(
            {
                "status": "ok",
                "model": model_name,
                "n_ctx": n_ctx,
                "running": admission.running,
                "waiting": admission.waiting,
                "stages": stages,
            }
        )

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    def model(name: str) -> dict[str, Any]:
        check_model(name)
        return model_card()

    @app.post("/v1/completions", response_model=None)
    async def completions(
        req: CompletionRequest, request: Request
    ) -> dict[str, Any] | StreamingResponse:
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        top = req.logprobs or 0

        def prepare() -> Generation:  # a remote tokenizer is a gRPC call: off the loop
            if isinstance(req.prompt, str):
                prompt = encode(req.prompt, "prompt")
            elif req.prompt and isinstance(req.prompt[0], str):
                prompt = encode(str(req.prompt[0]), "prompt")
            else:
                prompt = [int(t) for t in req.prompt]
            return plan(req, prompt, req.max_tokens, top, req.logprobs is not None, "prompt")

        gen = await run_in_threadpool(prepare)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        offset = [0]

        def logprobs(p: Piece) -> dict[str, Any] | None:
            if not gen.want_logprobs:
                return None
            out: dict[str, Any] = {
                "tokens": [],
                "token_logprobs": [],
                "top_logprobs": [] if top else None,
                "text_offset": [],
            }
            for t in p.tokens:
                text = t.piece.decode("utf-8", errors="replace")
                out["tokens"].append(text)
                out["token_logprobs"].append(t.logprob)
                out["text_offset"].append(offset[0])
                offset[0] += len(text)
                if top:
                    out["top_logprobs"].append(
                        {b.decode("utf-8", errors="replace"): lp for _, b, lp in t.top}
                    )
            return out

        def chunk(p: Piece) -> dict[str, Any]:
            body: dict[str, Any] = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model_name,
                "choices": [
                    {"index": 0, "text": p.text, "finish_reason": p.finish, "logprobs": logprobs(p)}
                ],
            }
            if include_usage:
                body["usage"] = None
            return body

        stream = await admitted(gen, request)
        if req.stream:
            final = None
            if include_usage:
                final = {**chunk(Piece("")), "choices": [], "usage": None}

            async def events() -> AsyncIterator[dict[str, Any]]:
                async for p in stream:
                    yield chunk(p)
                if final is not None:
                    final["usage"] = gen.usage()

            return StreamingResponse(sse(events(), final), media_type="text/event-stream")
        whole = await collect(stream)
        return {**chunk(whole), "usage": gen.usage()}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatRequest, request: Request) -> dict[str, Any] | StreamingResponse:
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        messages = [("system" if m.role == "developer" else m.role, m.text()) for m in req.messages]
        top = req.top_logprobs or 0

        def prepare() -> Generation:  # a remote tokenizer is a gRPC call: off the loop
            try:
                prompt_text = tokenizer.chat(messages)
            except RuntimeError as exc:
                raise OpenAIError(400, f"chat template: {exc}", param="messages") from exc
            return plan(
                req,
                encode(prompt_text, "messages"),
                req.max_completion_tokens or req.max_tokens,
                top,
                req.logprobs,
                "messages",
            )

        gen = await run_in_threadpool(prepare)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def logprobs(p: Piece) -> dict[str, Any] | None:
            if not gen.want_logprobs:
                return None

            def entry(piece: bytes, lp: float) -> dict[str, Any]:
                return {
                    "token": piece.decode("utf-8", errors="replace"),
                    "logprob": lp,
                    "bytes": list(piece),
                }

            return {
                "content": [
                    {
                        **entry(t.piece, t.logprob),
                        "top_logprobs": [entry(b, lp) for _, b, lp in t.top],
                    }
                    for t in p.tokens
                ]
            }

        stream = await admitted(gen, request)
        if req.stream:
            base = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model_name,
                **({"usage": None} if include_usage else {}),
            }
            final: dict[str, Any] | None = (
                {**base, "choices": [], "usage": None} if include_usage else None
            )

            async def events() -> AsyncIterator[dict[str, Any]]:
                role = {"role": "assistant", "content": ""}
                yield {
                    **base,
                    "choices": [
                        {"index": 0, "delta": role, "logprobs": None, "finish_reason": None}
                    ],
                }
                async for p in stream:
                    delta = {"content": p.text} if p.text else {}
                    choice = {
                        "index": 0,
                        "delta": delta,
                        "logprobs": logprobs(p),
                        "finish_reason": p.finish,
                    }
                    yield {**base, "choices": [choice]}
                if final is not None:
                    final["usage"] = gen.usage()

            return StreamingResponse(sse(events(), final), media_type="text/event-stream")
        whole = await collect(stream)
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model_name,
            "choices": [
                {
                    "index": 0,
                    "finish_reason": whole.finish,
                    "message": {"role": "assistant", "content": whole.text},
                    "logprobs": logprobs(whole),
                }
            ],
            "usage": gen.usage(),
        }

    async def collect(stream: Bridge) -> Piece:
        whole = Piece("")
        texts = []
        try:
            async for p in stream:
                texts.append(p.text)
                whole.tokens.extend(p.tokens)
                whole.finish = p.finish or whole.finish
        except RouteError as exc:
            raise from_route_error(exc) from exc
        whole.text = "".join(texts)
        return whole

    return app
