"""Incremental detokenization against the model's real tokenizer, and the stop-sequence matcher,
as the client surfaces call them."""

from __future__ import annotations

from pathlib import Path

import pytest
from dgr_route.text import Detokenizer, StopMatcher, stop_list
from dgr_route.tokenizer import Tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

SCRIPTS = {
    "cyrillic": "Привет, как дела? Сегодня хорошая погода.",
    "greek": "Καλημέρα κόσμε, τι κάνεις σήμερα;",
    "devanagari": "नमस्ते दुनिया, आप कैसे हैं?",
    "cjk": "你好，世界。今日は良い天気ですね。안녕하세요",  # noqa: RUF001
    "emoji": "Hello 👋🏽 world 🌍🚀 family 👨‍👩‍👧‍👦 ok",
}


@pytest.fixture(scope="module")
def tokenizer(smollm2: Path) -> Tokenizer:
    return Tokenizer(smollm2)


def streamed(tokenizer: Tokenizer, tokens: list[int]) -> tuple[str, list[str]]:
    detok = Detokenizer(tokenizer.detokenize)
    pieces = [detok.feed(t) for t in tokens] + [detok.flush()]
    return "".join(pieces), pieces


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_streamed_text_equals_the_whole_sequence(tokenizer: Tokenizer, script: str) -> None:
    tokens = tokenizer.encode(SCRIPTS[script])
    whole = tokenizer.detokenize(tokens).decode("utf-8", errors="replace")
    text, _pieces = streamed(tokenizer, tokens)
    assert text == whole
    assert SCRIPTS[script] in text and "\ufffd" not in text


def test_one_token_at_a_time_would_corrupt_these_scripts(tokenizer: Tokenizer) -> None:
    """Why the Detokenizer exists: byte-level BPE splits these characters across tokens."""
    broken = []
    for name, text in SCRIPTS.items():
        tokens = tokenizer.encode(text)
        alone = "".join(tokenizer.detokenize([t]).decode("utf-8", errors="replace") for t in tokens)
        if "\ufffd" in alone:
            broken.append(name)
    assert {"devanagari", "emoji"} <= set(broken), broken


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_token_sequence_streams_to_its_whole_text(
    tokenizer: Tokenizer, data: st.DataObject
) -> None:
    n_vocab = int(tokenizer.vocab.n_vocab)
    tokens = data.draw(st.lists(st.integers(0, n_vocab - 1), max_size=40))
    whole = tokenizer.detokenize(tokens).decode("utf-8", errors="replace")
    assert streamed(tokenizer, tokens)[0] == whole


def reference(chunks: list[str], stops: list[str]) -> tuple[str, bool]:
    """What a client must receive: the text up to the first stop string, found as soon as the
    text generated so far contains one; all of it when none ever appears."""
    text = ""
    for chunk in chunks:
        text += chunk
        found = [i for s in stops if (i := text.find(s)) >= 0]
        if found:
            return text[: min(found)], True
    return text, False


@settings(max_examples=400, deadline=None)
@given(
    chunks=st.lists(st.text(alphabet="ab\n ", max_size=4), max_size=12),
    stops=st.lists(st.text(alphabet="ab\n ", min_size=1, max_size=4), max_size=4),
)
def test_stop_matcher_against_the_reference(chunks: list[str], stops: list[str]) -> None:
    matcher = StopMatcher(stops)
    out, hit = [], False
    for chunk in chunks:
        text, hit = matcher.feed(chunk)
        out.append(text)
        if hit:
            break
    out.append(matcher.flush())
    assert ("".join(out), hit) == reference(chunks, stops)
    # what went out never ends in a stop string's beginning while the generation is unfinished
    for stop in stops:
        assert stop not in "".join(out)


def test_stop_matcher_holds_a_partial_match_until_it_resolves() -> None:
    m = StopMatcher(["\n\n", "END"])
    assert m.feed("Hello\n") == ("Hello", False)  # "\n" may begin "\n\n": held
    assert m.feed("world E") == ("\nworld ", False)  # it did not; "E" is held now
    assert m.feed("N") == ("", False)
    assert m.feed("D and more") == ("", True)
    assert m.matched == "END" and m.flush() == ""
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", False)
    assert m.flush() == "ST"  # the generation ended without the stop: the tail goes out


def test_stop_list_follows_openai() -> None:
    assert stop_list(None) == [] and stop_list("x") == ["x"] and stop_list(["a", "b"]) == ["a", "b"]
    with pytest.raises(ValueError, match="at most 4"):
        stop_list(["a", "b", "c", "d", "e"])
    with pytest.raises(ValueError, match="empty"):
        stop_list(["a", ""])
