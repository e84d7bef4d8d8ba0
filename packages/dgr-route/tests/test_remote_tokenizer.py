"""A client with no GGUF: the head worker's tokenizer over gRPC (dgr.v1.TokenizerService) gives
exactly what the local vocabulary gives, refuses malformed requests by field, and lets `dgr
generate` run with nothing but the route's addresses."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from dgr.v1 import shard_pb2 as pb
from dgr_route.route import Route
from dgr_route.tokenizer import RemoteTokenizer, Tokenizer, TokenizerError, tokenizer_for

TEXTS = [
    "Hello, world!",
    "Привет, как дела?",
    "Καλημέρα κόσμε",
    "नमस्ते दुनिया",
    "你好世界。日本語も",
    "emoji 🙂🚀 and\ttabs\n\nnewlines  double  spaces",
    "",
]


@pytest.fixture(scope="module")
def head(metered_workers: list[Any]) -> Iterator[Route]:
    route = Route.open([w.address for w in metered_workers])
    yield route
    route.close()


@pytest.fixture(scope="module")
def remote(head: Route) -> RemoteTokenizer:
    tokenizer = tokenizer_for(None, head)
    assert isinstance(tokenizer, RemoteTokenizer)
    return tokenizer


@pytest.fixture(scope="module")
def local(smollm2: Path) -> Tokenizer:
    return Tokenizer(smollm2)


def test_the_remote_tokenizer_is_the_local_one(remote: RemoteTokenizer, local: Tokenizer) -> None:
    assert remote.n_vocab == local.n_vocab == local.vocab.n_vocab
    assert remote.eog_ids == local.eog_ids and remote.eog_ids
    for text in TEXTS:
        assert remote.encode(text) == local.encode(text), text
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 40):
        tokens = [int(t) for t in rng.integers(0, remote.n_vocab, n)]
        assert remote.detokenize(tokens) == local.detokenize(tokens)
    chat = [
        ("system", "Be brief."),
        ("user", "Name a river."),
        ("assistant", "Nile."),
        ("user", "Another?"),
    ]
    assert remote.chat(chat) == local.chat(chat)


def call(head: Route, name: str, request: Any) -> grpc.RpcError:
    from dgr.v1 import shard_pb2_grpc as pb_grpc

    stub = pb_grpc.TokenizerServiceStub(head.stages[0].channel)  # type: ignore[no-untyped-call]
    with pytest.raises(grpc.RpcError) as info:
        getattr(stub, name)(request, timeout=10)
    return info.value


@pytest.mark.parametrize(
    ("name", "request_", "detail"),
    [
        (
            "Detokenize",
            pb.DetokenizeRequest(tokens=[1, -1]),
            r"tokens\[1\] = -1 is outside the vocabulary \[0, 49152\)",
        ),
        ("Detokenize", pb.DetokenizeRequest(tokens=[49152]), r"tokens\[0\] = 49152 is outside"),
        (
            "Tokenize",
            pb.TokenizeRequest(text=b"x" * (4 * 2**20 + 1)),
            r"text: 4194305 bytes, more than 4194304",
        ),
        ("ApplyChatTemplate", pb.ChatTemplateRequest(), r"messages: 0, must be 1 to 4096"),
        (
            "ApplyChatTemplate",
            pb.ChatTemplateRequest(messages=[pb.ChatMessage(role=b"", content=b"hi")]),
            r"messages\[0\]\.role: must be 1 to 64 bytes",
        ),
        (
            "ApplyChatTemplate",
            pb.ChatTemplateRequest(
                messages=[pb.ChatMessage(role=b"user", content=b"x" * (4 * 2**20 + 1))]
            ),
            r"messages: content of more than 4194304 bytes",
        ),
    ],
)
def test_malformed_requests_are_refused_by_field(
    head: Route, name: str, request_: Any, detail: str
) -> None:
    import re

    err = call(head, name, request_)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(detail, err.details() or ""), err.details()


def test_a_refusal_is_a_typed_error_naming_the_worker(remote: RemoteTokenizer) -> None:
    with pytest.raises(
        TokenizerError, match=r"127\.0\.0\.1:\d+: Detokenize failed: INVALID_ARGUMENT"
    ):
        remote.detokenize([remote.n_vocab + 5])
    assert remote.detokenize([]) == b""  # the worker still serves


def test_dgr_generate_needs_only_the_route(metered_workers: list[Any], smollm2: Path) -> None:
    dgr = str(Path(sys.executable).parent / "dgr")
    route = ",".join(w.address for w in metered_workers)
    base = [dgr, "generate", "--route", route, "--max-tokens", "12", "The capital of France is"]
    remote = subprocess.run(base, capture_output=True, text=True, timeout=120, check=True)
    local = subprocess.run(
        [*base, "--model", str(smollm2)], capture_output=True, text=True, timeout=120, check=True
    )
    assert remote.stdout == local.stdout and len(remote.stdout.strip()) > 5
