"""The layout scenario generator (pure: no model needed)."""

from __future__ import annotations

import pytest
from dgr_native.scenarios import ModelStructure, check_layout, generate
from dgr_native.twins import FULL, TWINS

FULL_TWIN = ModelStructure(
    n_layer=TWINS[FULL].n_layer,
    hash_layers=TWINS[FULL].hash_layers,
    compress_ratios=tuple(TWINS[FULL].compress_ratios()),
)


def test_every_layout_is_a_contiguous_cover_and_distinct() -> None:
    scenarios = generate(FULL_TWIN, [2, 3, 4, 11])
    layouts = [tuple(s.layout) for s in scenarios]
    assert len(layouts) == len(set(layouts))
    for s in scenarios:
        check_layout(FULL_TWIN.n_layer, s.layout)
    assert {len(s.layout) for s in scenarios} == {2, 3, 4, 11}


def test_the_fragile_seams_are_covered() -> None:
    scenarios = generate(FULL_TWIN, [2, 3, 4, 11])
    seams = [set(s.seams) for s in scenarios]
    hca = [i for i, r in enumerate(FULL_TWIN.compress_ratios) if r == 128]
    assert any(1 in s for s in seams) and any({1, 2} <= s for s in seams)
    assert any(FULL_TWIN.hash_layers in s for s in seams)
    assert any({hca[0], hca[0] + 1} <= s for s in seams)
    for k in (2, 3, 4, 11):
        assert any(1 in s for s, sc in zip(seams, scenarios, strict=True) if len(sc.layout) == k)


def test_the_generator_is_deterministic_and_seeded() -> None:
    assert generate(FULL_TWIN, [3, 11], seed=7) == generate(FULL_TWIN, [3, 11], seed=7)
    assert generate(FULL_TWIN, [11], seed=7) != generate(FULL_TWIN, [11], seed=8)


def test_impossible_stage_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot split"):
        generate(ModelStructure(n_layer=3), [4])
    with pytest.raises(ValueError, match="not a contiguous split"):
        check_layout(6, [(0, 2), (3, 6)])
