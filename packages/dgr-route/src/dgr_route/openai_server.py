"""An OpenAI-compatible HTTP front for a route: /v1/models, /v1/completions and
/v1/chat/completions (the model's own chat template), with SSE streaming.

Each request is one route session; the sync gRPC route runs in Starlette's thread pool, so
requests proceed concurrently up to the workers' session slots (a full worker answers
RESOURCE_EXHAUSTED, which becomes HTTP 503).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from dgr_route.route import Route, RouteError, Sampling


class ChatMessage(BaseModel):
    role: str
    content: str


class CompletionRequest(BaseModel):
    model: str = ""
    prompt: str
    max_tokens: int = Field(default=64, ge=1, le=4096)
    temperature: float = Field(default=1.0, ge=0.0, le=5.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    seed: int | None = None
    stream: bool = False


class ChatRequest(BaseModel):
    model: str = ""
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=4096)
    temperature: float = Field(default=1.0, ge=0.0, le=5.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    seed: int | None = None
    stream: bool = False


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def create_app(route: Route, tokenizer: Any, model_name: str) -> FastAPI:
    app = FastAPI(title="DGR", description="OpenAI-compatible API over a DGR route")

    def pieces(
        prompt: str, max_tokens: int, sampling: Sampling
    ) -> Iterator[tuple[str, str | None]]:
        """(text piece, finish reason or None) as tokens come out of the route."""
        tokens = tokenizer.encode(prompt)
        try:
            for token in route.generate(tokens, max_tokens, sampling):
                if tokenizer.is_eog(token):
                    yield "", "stop"
                    return
                yield tokenizer.piece(token), None
        except RouteError as exc:
            status = 503 if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED else 502
            raise HTTPException(status, f"route failed: {exc}") from exc
        yield "", "length"

    def sampling_of(temperature: float, top_p: float, seed: int | None) -> Sampling:
        return Sampling(
            temperature=temperature,
            top_p=top_p if top_p < 1.0 else 0.0,
            seed=seed if seed is not None else uuid.uuid4().int & (2**63 - 1),
        )

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "owned_by": "dgr", "created": 0}],
        }

    @app.post("/v1/completions", response_model=None)
    def completions(req: CompletionRequest) -> dict[str, Any] | StreamingResponse:
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        gen = pieces(req.prompt, req.max_tokens, sampling_of(req.temperature, req.top_p, req.seed))

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model_name,
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
            }

        if req.stream:
            return StreamingResponse(
                _with_done(_sse(chunk(t, f)) for t, f in gen), media_type="text/event-stream"
            )
        text, finish = _collect(gen)
        return {**chunk(text, finish), "usage": _usage(tokenizer, req.prompt, text)}

    @app.post("/v1/chat/completions", response_model=None)
    def chat(req: ChatRequest) -> dict[str, Any] | StreamingResponse:
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        try:
            prompt = tokenizer.chat([(m.role, m.content) for m in req.messages])
        except RuntimeError as exc:
            raise HTTPException(400, str(exc)) from exc
        max_tokens = req.max_completion_tokens or req.max_tokens or 256
        gen = pieces(prompt, max_tokens, sampling_of(req.temperature, req.top_p, req.seed))
        if req.stream:

            def events() -> Iterator[str]:
                base = {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model_name,
                }
                yield _sse(
                    {
                        **base,
                        "choices": [
                            {"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}
                        ],
                    }
                )
                for text, finish in gen:
                    delta = {"content": text} if text else {}
                    yield _sse(
                        {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
                    )

            return StreamingResponse(_with_done(events()), media_type="text/event-stream")
        text, finish = _collect(gen)
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model_name,
            "choices": [
                {
                    "index": 0,
                    "finish_reason": finish,
                    "message": {"role": "assistant", "content": text},
                }
            ],
            "usage": _usage(tokenizer, prompt, text),
        }

    return app


def _with_done(events: Iterator[str]) -> Iterator[str]:
    yield from events
    yield "data: [DONE]\n\n"


def _collect(gen: Iterator[tuple[str, str | None]]) -> tuple[str, str]:
    parts, finish = [], "length"
    for text, reason in gen:
        parts.append(text)
        if reason:
            finish = reason
    return "".join(parts), finish


def _usage(tokenizer: Any, prompt: str, text: str) -> dict[str, int]:
    p, c = len(tokenizer.encode(prompt)), len(tokenizer.encode(text)) if text else 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
