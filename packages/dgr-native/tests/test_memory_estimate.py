"""The per-range memory estimator (story DGR-058): llama.cpp's dry run predicts, before anything
is allocated, exactly the weights, KV and compute buffers a stage then allocates; an estimating
engine cannot run."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from dgr_native.memory import STAGE_OPTIONS, estimate_range


@pytest.mark.parametrize("layers", [(0, 10), (10, 20), (20, 30)])
def test_the_estimate_equals_what_the_stage_allocates(
    engine_module: ModuleType, smollm2: Path, layers: tuple[int, int]
) -> None:
    estimate = estimate_range(smollm2, *layers, **STAGE_OPTIONS)
    real = engine_module.Engine(str(smollm2), *layers, **STAGE_OPTIONS).describe()
    assert (estimate["weights"], estimate["kv"], estimate["compute"]) == (
        real["weight_bytes"],
        real["kv_bytes"],
        real["compute_bytes"],
    )
    assert estimate["per_kv_token"] > 0


def test_the_estimate_covers_v4_state(engine_module: ModuleType, quick_twin: Path) -> None:
    for layers in [(0, 2), (2, 6)]:
        estimate = estimate_range(quick_twin, *layers, **STAGE_OPTIONS)
        real = engine_module.Engine(str(quick_twin), *layers, **STAGE_OPTIONS).describe()
        assert (estimate["kv"], estimate["compute"]) == (real["kv_bytes"], real["compute_bytes"])


def test_an_estimating_engine_cannot_run(engine_module: ModuleType, smollm2: Path) -> None:
    engine = engine_module.Engine(str(smollm2), 0, 10, estimate_only=True, **STAGE_OPTIONS)
    with pytest.raises(engine_module.ShardError, match="only estimates") as info:
        engine.forward(1, 1, 0, tokens=np.array([1, 2, 3], dtype=np.int32))
    assert info.value.status == "invalid_argument"
