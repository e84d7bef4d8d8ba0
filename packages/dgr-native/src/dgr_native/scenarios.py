"""Layouts for certification, generated from the model's structure rather than written by hand.

For each stage count the generator yields an even split, then splits with a seam forced where the
V4 seam is most fragile: inside the hash-routed block (after its first and second layer, where
the token-ID sideband must reach the next stage), right before and right after an HCA
(compress ratio 128) layer, and right after the last hash-routed layer; the remaining seams are
spread evenly. A seeded random split per stage count covers the rest. Every layout is checked to
be contiguous and to cover [0, n_layer) with non-empty stages.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

Layout = list[tuple[int, int]]


@dataclass(frozen=True)
class Scenario:
    name: str
    layout: Layout

    @property
    def seams(self) -> list[int]:
        return [a for a, _ in self.layout[1:]]


@dataclass(frozen=True)
class ModelStructure:
    n_layer: int
    hash_layers: int = 0
    compress_ratios: tuple[int, ...] = ()


def layout_from_seams(n_layer: int, seams: set[int]) -> Layout:
    bounds = [0, *sorted(seams), n_layer]
    layout = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    check_layout(n_layer, layout)
    return layout


def check_layout(n_layer: int, layout: Layout) -> None:
    expected = 0
    for a, b in layout:
        if a != expected or b <= a:
            raise ValueError(f"layout {layout} is not a contiguous split of [0, {n_layer})")
        expected = b
    if expected != n_layer:
        raise ValueError(f"layout {layout} ends at {expected}, the model has {n_layer} layers")


def _fill(n_layer: int, forced: set[int], n_stages: int) -> set[int] | None:
    """Add seams evenly between the forced ones until there are n_stages - 1 of them."""
    seams = {s for s in forced if 0 < s < n_layer}
    if len(seams) > n_stages - 1:
        return None
    while len(seams) < n_stages - 1:
        bounds = [0, *sorted(seams), n_layer]
        gaps = [(bounds[i + 1] - bounds[i], bounds[i]) for i in range(len(bounds) - 1)]
        width, start = max(gaps)
        if width < 2:
            return None
        seams.add(start + width // 2)
    return seams


def generate(model: ModelStructure, stage_counts: list[int], seed: int = 0) -> list[Scenario]:
    """Distinct layouts for every stage count, in a stable order."""
    rng = random.Random(seed)
    hca = [i for i, r in enumerate(model.compress_ratios[: model.n_layer]) if r == 128]
    forced: list[tuple[str, set[int]]] = []
    if model.hash_layers >= 2:
        forced.append(("seam-after-layer-1", {1}))
        forced.append(("seams-after-layers-1-and-2", {1, 2}))
    if model.hash_layers >= 1:
        forced.append(("seam-after-hash-block", {model.hash_layers}))
    if hca:
        forced.append((f"seams-around-hca-layer-{hca[0]}", {hca[0], hca[0] + 1}))
        mid = hca[len(hca) // 2]
        forced.append((f"seam-before-hca-layer-{mid}", {mid}))

    out: list[Scenario] = []
    seen: set[tuple[tuple[int, int], ...]] = set()

    def add(name: str, seams: set[int] | None) -> None:
        if seams is None:
            return
        layout = layout_from_seams(model.n_layer, seams)
        key = tuple(layout)
        if key not in seen:
            seen.add(key)
            out.append(Scenario(f"{len(layout)}-stage {name}", layout))

    for k in stage_counts:
        if not 1 <= k <= model.n_layer:
            raise ValueError(f"{k} stages cannot split {model.n_layer} layers")
        add("even", _fill(model.n_layer, set(), k))
        for name, seams in forced:
            add(name, _fill(model.n_layer, seams, k))
        add(f"random(seed={seed})", set(rng.sample(range(1, model.n_layer), k - 1)))
    return out
