"""Range ownership beyond llama and V4 (story DGR-033): qwen2, qwen3 and deepseek2 (MLA, MoE)
on generated random-weight models, and gemma3 on the real Gemma-3-270M, chained over generated
layouts give logits bit for bit equal to the whole model in one process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from dgr_native.parity import compare, reference_run
from dgr_native.scenarios import ModelStructure, generate
from dgr_native.twins import ARCH_TWINS, twin_path
from dgr_native.twins import generate as generate_twin


@pytest.mark.parametrize("name", [t.name for t in ARCH_TWINS])
def test_arch_twins_are_deterministic_and_recorded(name: str, tmp_path: Path) -> None:
    from dgr_artifacts.manifest import build_manifest, load_manifest
    from dgr_native.cli import twin_manifest_path
    from dgr_native.twins import TWINS

    fresh = build_manifest(generate_twin(TWINS[name], tmp_path / "twin.gguf"))
    recorded = load_manifest(twin_manifest_path(name))
    assert fresh.files[0].sha256 == recorded.files[0].sha256
    assert fresh.model_fingerprint == recorded.model_fingerprint


def chained_parity(model: Path, n_layer: int, n_vocab: int) -> list[str]:
    prompt = np.random.default_rng(4).integers(0, n_vocab, 40).astype(np.int32)
    tokens, ref_logits, ref_tokens = reference_run(model, 4, prompt)
    failed = []
    for scenario in generate(ModelStructure(n_layer), [2, 3, 4]):
        result = compare(model, scenario.layout, "f32", tokens, ref_logits, ref_tokens)
        if not result.bitwise_equal:
            failed.append(f"{scenario.name} {scenario.layout}: max |dlogit| {result.max_abs_diff}")
    return failed


@pytest.mark.parametrize("twin", ARCH_TWINS, ids=lambda t: t.arch)
def test_generated_archs_chain_bitwise(twin: object) -> None:
    from dgr_native.twins import ArchTwin

    assert isinstance(twin, ArchTwin)
    assert chained_parity(twin_path(twin.name), twin.n_layer, twin.n_vocab) == []


def test_gemma3_chains_bitwise() -> None:
    from dgr_artifacts.models import model_path

    assert chained_parity(model_path("gemma3-270m-q4_k_m"), 18, 262144) == []
