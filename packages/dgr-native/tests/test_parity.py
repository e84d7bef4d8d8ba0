"""Bitwise parity of chained in-process engines with the whole model (fast subset; the full
2/3/5-stage x 64-step run on both real models is `nox -s parity`)."""

from __future__ import annotations

from pathlib import Path

from dgr_native.parity import compare, reference_run
from dgr_route.local import even_layout


def test_three_stages_are_bitwise_equal_for_prompt_and_decode(smollm2: Path) -> None:
    prompt, logits, tokens = reference_run(smollm2, n_decode=8)
    result = compare(smollm2, even_layout(30, 3), "f32", prompt, logits, tokens)
    assert result.steps == 9
    assert result.bitwise_equal and result.max_abs_diff == 0.0 and result.greedy_identical


def test_f16_boundary_is_close_but_reported(smollm2: Path) -> None:
    prompt, logits, tokens = reference_run(smollm2, n_decode=4)
    result = compare(smollm2, [(0, 7), (7, 30)], "f16", prompt, logits, tokens)
    assert not result.bitwise_equal
    assert 0 < result.nmse < 1e-2
    assert result.boundary_bytes_per_token == 576 * 2


def test_even_layout() -> None:
    assert even_layout(30, 3) == [(0, 10), (10, 20), (20, 30)]
    assert even_layout(18, 5) == [(0, 4), (4, 7), (7, 11), (11, 14), (14, 18)]
