"""PrefixIndex, the coordinator's hint of which token histories a route's stages hold: the
longest shared prefix is found, capped so the last prompt token is computed, taken out while in
use, and bounded (checked against a brute-force reference)."""

from __future__ import annotations

from dgr_route.prefixes import PrefixIndex
from hypothesis import given
from hypothesis import strategies as st


def test_the_longest_shared_history_is_taken_and_leaves_the_index() -> None:
    index = PrefixIndex(min_tokens=3)
    index.put([1, 2, 3, 4, 5, 6])
    index.put([1, 2, 9, 9])
    assert len(index) == 2
    assert index.take([1, 2, 3, 4, 7, 7, 7]) == 4  # shares 1 2 3 4 with the first
    assert len(index) == 1
    assert index.take([1, 2, 3, 4, 7]) == 0  # the first is taken: [1, 2, 9, 9] shares only 2
    assert len(index) == 1  # nothing taken when nothing is reused


def test_the_last_prompt_token_is_always_computed() -> None:
    index = PrefixIndex(min_tokens=2)
    index.put([5, 6, 7, 8])
    assert index.take([5, 6, 7, 8]) == 3  # the same prompt again: all but its last token


def test_a_longer_history_covers_the_shorter_it_starts_with_and_capacity_evicts_the_oldest() -> (
    None
):
    index = PrefixIndex(capacity=2, min_tokens=2)
    index.put([1, 2, 3])
    index.put([1, 2, 3, 4, 5])  # covers [1, 2, 3]
    assert len(index) == 1
    index.put([7, 7, 7])
    index.put([8, 8, 8])  # the third history: the oldest, [1 2 3 4 5], goes
    assert len(index) == 2
    assert index.take([1, 2, 3, 4, 5, 6]) == 0
    assert index.take([8, 8, 8, 1]) == 3


def test_short_histories_are_not_remembered() -> None:
    index = PrefixIndex(min_tokens=8)
    index.put(list(range(7)))
    assert len(index) == 0


def reference(held: list[list[int]], prompt: list[int], min_tokens: int) -> int:
    def common(a: list[int]) -> int:
        n = 0
        while n < min(len(a), len(prompt) - 1) and a[n] == prompt[n]:
            n += 1
        return n

    best = max((common(h) for h in held), default=0)
    return best if best >= min_tokens else 0


tokens = st.lists(st.integers(0, 2), min_size=0, max_size=10)


@given(st.lists(tokens, max_size=6), tokens)
def test_take_matches_the_brute_force_reference(
    histories: list[list[int]], prompt: list[int]
) -> None:
    index = PrefixIndex(capacity=64, min_tokens=2)
    for h in histories:
        index.put(h)
    # what the index holds after coverage: histories no later one starts with
    kept = [
        h
        for i, h in enumerate(histories)
        if len(h) >= 2
        and not any(len(h) <= len(later) and later[: len(h)] == h for later in histories[i + 1 :])
    ]
    assert index.take(prompt) == reference(kept, prompt, 2)
