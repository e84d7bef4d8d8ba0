"""The OpenAI-compatible API over a real route, driven by the official `openai` client."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import uvicorn
from dgr_route.cli import Tokenizer
from dgr_route.openai_server import create_app
from dgr_route.route import Route
from dgr_route.workers import descriptor_args, start_worker


@pytest.fixture(scope="module")
def client(smollm2: Path) -> Iterator[openai.OpenAI]:
    descriptor = descriptor_args(smollm2)
    workers = [
        start_worker(smollm2, a, b, descriptor=descriptor, n_ctx=1024)
        for a, b in [(0, 15), (15, 30)]
    ]
    route = Route.open([w.address for w in workers])
    app = create_app(route, Tokenizer(smollm2), "smollm2")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    server.should_exit = True
    thread.join(10)
    route.close()
    for w in workers:
        w.stop()


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["smollm2"]


def test_chat_completion_streams_the_same_text(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(
        model="smollm2",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=24,
        temperature=0,
    )
    text = whole.choices[0].message.content or ""
    assert "Paris" in text and whole.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(
        model="smollm2",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=24,
        temperature=0,
        stream=True,
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([p for p in pieces if p]) > 3
    assert "".join(pieces) == text


def test_completion_with_sampling(client: openai.OpenAI) -> None:
    greedy = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert "Paris" in greedy.choices[0].text
    assert greedy.usage is not None and greedy.usage.prompt_tokens > 3
    seeded = [
        client.completions.create(
            model="smollm2",
            prompt="Once upon a time",
            max_tokens=12,
            temperature=0.9,
            top_p=0.95,
            seed=7,
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    chunks = list(
        client.completions.create(
            model="smollm2",
            prompt="The capital of France is",
            max_tokens=8,
            temperature=0,
            stream=True,
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == greedy.choices[0].text
