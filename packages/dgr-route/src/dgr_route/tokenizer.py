"""The model's tokenizer for a client: from a local GGUF (a vocabulary-only load), or from the
route's head worker over gRPC (dgr.v1.TokenizerService), so that `dgr generate`, `dgr serve` and
`dgr chat` need nothing but the route's addresses. Both give the same ids, bytes, end-of-generation
set and chat prompt: the worker runs the same llama.cpp vocabulary code."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from dgr.v1 import shard_pb2 as pb
from dgr.v1 import shard_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from dgr_route.route import Route


class TokenizerLike(Protocol):
    """What the clients need of the model's tokenizer."""

    eog_ids: frozenset[int]
    n_vocab: int  # token ids lie in [0, n_vocab)

    def encode(self, text: str) -> list[int]: ...
    def detokenize(self, tokens: list[int]) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...
    def chat(self, messages: Sequence[tuple[str, str]]) -> str: ...


class TokenizerError(RuntimeError):
    """The head worker refused or failed a tokenizer call; names the worker and the gRPC code."""

    def __init__(self, address: str, call: str, exc: grpc.RpcError) -> None:
        self.address, self.code = address, exc.code()
        super().__init__(f"{address}: {call} failed: {exc.code().name}: {exc.details()}")


class Tokenizer:
    """The model's own tokenizer, from a local copy of the GGUF: a vocabulary-only load (llama.cpp's
    `vocab_only`: metadata and vocabulary, no weights)."""

    def __init__(self, model: Path) -> None:
        from dgr_route.engine import locate

        self.vocab = locate().module().Vocabulary(str(model))
        self.n_vocab = int(self.vocab.n_vocab)
        # end-of-generation ids go to the route as its stop ids: the head stops decoding itself
        self.eog_ids = frozenset(t for t in range(self.n_vocab) if self.vocab.is_eog(t))

    def encode(self, text: str) -> list[int]:
        return list(self.vocab.tokenize(text, True))

    def detokenize(self, tokens: list[int]) -> bytes:
        return bytes(self.vocab.detokenize(tokens))

    def is_eog(self, token: int) -> bool:
        return token in self.eog_ids

    def chat(self, messages: Sequence[tuple[str, str]]) -> str:
        return str(self.vocab.apply_chat_template(messages, True))


class RemoteTokenizer:
    """The head worker's tokenizer, over the route's own channel and credentials. Detokenizing a
    stream asks for short windows of tokens, many of them twice; the last answers are kept."""

    CACHE = 256

    def __init__(
        self,
        channel: grpc.Channel,
        address: str,
        metadata: tuple[tuple[str, str], ...] = (),
        timeout: float = 30.0,
    ) -> None:
        self.address, self._metadata, self._timeout = address, metadata, timeout
        self._stub = pb_grpc.TokenizerServiceStub(channel)  # type: ignore[no-untyped-call]
        reply = self._call("Vocabulary", pb.VocabularyRequest())
        self.n_vocab = int(reply.n_vocab)
        self.eog_ids = frozenset(int(t) for t in reply.eog)
        self._detokenize = functools.lru_cache(maxsize=self.CACHE)(self._ask_detokenize)

    def _call(self, name: str, request: Any) -> Any:
        try:
            return getattr(self._stub, name)(
                request, timeout=self._timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise TokenizerError(self.address, name, exc) from exc

    def encode(self, text: str) -> list[int]:
        reply = self._call("Tokenize", pb.TokenizeRequest(text=text.encode(), add_special=True))
        return list(reply.tokens)

    def _ask_detokenize(self, tokens: tuple[int, ...]) -> bytes:
        return bytes(self._call("Detokenize", pb.DetokenizeRequest(tokens=tokens)).text)

    def detokenize(self, tokens: list[int]) -> bytes:
        return self._detokenize(tuple(tokens))

    def is_eog(self, token: int) -> bool:
        return token in self.eog_ids

    def chat(self, messages: Sequence[tuple[str, str]]) -> str:
        request = pb.ChatTemplateRequest(
            messages=[pb.ChatMessage(role=r.encode(), content=c.encode()) for r, c in messages],
            add_assistant=True,
        )
        return bytes(self._call("ApplyChatTemplate", request).prompt).decode(errors="replace")


def tokenizer_for(model: Path | None, route: Route) -> Tokenizer | RemoteTokenizer:
    """A local GGUF's vocabulary when one is given, else the route's head worker's."""
    if model is not None:
        return Tokenizer(model)
    head = route.stages[0]
    return RemoteTokenizer(head.channel, head.address, head.metadata)
