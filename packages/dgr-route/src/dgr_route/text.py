"""Text out of a stream of tokens: incremental UTF-8 detokenization and stop sequences.

Both are shared by every client surface (`dgr generate`, `dgr chat`, the OpenAI server), so
that what a client reads, concatenated, is exactly the text of the whole sequence.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence

MAX_STOP_SEQUENCES = 4  # as OpenAI's API


class Detokenizer:
    """The text a growing token sequence adds, one token at a time.

    A token may end in the middle of a multi-byte UTF-8 character (byte-level BPE splits them);
    those bytes are held until the character completes, so nothing becomes U+FFFD that the
    whole sequence would not. Each step re-detokenizes a short window (the last emitted tokens
    as context) rather than one token alone, so tokenizers whose pieces depend on their
    neighbours (a leading space, clean-up of spaces) still concatenate to the whole text.
    """

    CONTEXT = 4  # tokens of context before the new one

    def __init__(self, detokenize: Callable[[list[int]], bytes]) -> None:
        self._detokenize = detokenize
        self._tokens: list[int] = []
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._fed = 0  # bytes passed to the decoder so far

    def feed(self, token: int) -> str:
        """The text that becomes certain with `token` (possibly empty)."""
        start = max(0, len(self._tokens) - self.CONTEXT)
        before = self._detokenize(self._tokens[start:]) if self._tokens else b""
        self._tokens.append(token)
        after = self._detokenize(self._tokens[start:])
        if after.startswith(before):
            added = after[len(before) :]
        else:  # the new token changed its neighbours' text: take the whole sequence's word
            whole, fed = self._detokenize(self._tokens), self._fed
            added = whole[fed:] if len(whole) >= fed else b""
        self._fed += len(added)
        return self._decoder.decode(added, final=False)

    def flush(self) -> str:
        """Bytes still held at the end of the sequence (an incomplete character: U+FFFD)."""
        return self._decoder.decode(b"", final=True)


class StopMatcher:
    """Holds text back while it could still become one of the stop strings.

    `feed` returns the text that can safely go out and whether a stop string was completed; the
    stop string itself and anything after it never go out. At the end of a generation that
    matched nothing, `flush` releases the held tail.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        if self.matched is not None:
            return "", True
        buf = self._held + text
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            index, self.matched = min(hits)
            self._held = ""
            return buf[:index], True
        keep = self._partial(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _partial(self, buf: str) -> int:
        """The length of the longest tail of `buf` that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:n]):
                    longest = n
                    break
        return longest


def stop_list(stop: str | list[str] | None) -> list[str]:
    """OpenAI's `stop`: a string, a list of up to four, or nothing; empty strings are refused."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}")
    if any(not s for s in stops):
        raise ValueError("a stop sequence cannot be empty")
    return stops
