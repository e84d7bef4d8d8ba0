"""DGR-056: a recipe names its model's manifest, a quantization, per-node layer ranges and a wire
dtype; checked against the real artifact manifests, anything the artifacts lack is refused by
name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from dgr_artifacts.manifest import ArtifactManifest, build_manifest
from dgr_artifacts.models import model_path
from dgr_placement.recipe import (
    LayerCoverage,
    Recipe,
    TensorTypeMismatch,
    UnknownQuantization,
    UnknownTensor,
    WrongModel,
    load_recipe,
    main_quantization,
)
from pydantic import ValidationError


@pytest.fixture(scope="module")
def smollm2_manifest(smollm2: Path) -> ArtifactManifest:
    return build_manifest(smollm2)


@pytest.fixture(scope="module")
def gemma3_manifest() -> ArtifactManifest:
    return build_manifest(model_path("gemma3-270m-q4_k_m"))


def fields(manifest: ArtifactManifest, **changes: Any) -> dict[str, Any]:
    n = manifest.n_layer
    base: dict[str, Any] = {
        "name": "split-3",
        "model_fingerprint": manifest.model_fingerprint,
        "manifest_sha256": manifest.digest(),
        "quantization": main_quantization(manifest),
        "wire_dtype": "bf16",
        "stages": [
            {"node": "a", "layers": {"first": 0, "last": n // 3}},
            {"node": "b", "layers": {"first": n // 3, "last": 2 * n // 3}},
            {"node": "c", "layers": {"first": 2 * n // 3, "last": n}},
        ],
    }
    return {**base, **changes}


def test_main_quantization_is_what_the_files_hold(
    smollm2_manifest: ArtifactManifest, gemma3_manifest: ArtifactManifest
) -> None:
    assert main_quantization(smollm2_manifest) == "Q4_1"
    assert main_quantization(gemma3_manifest) in {"Q4_K", "Q5_0"}  # Q4_K_M mixes types


@pytest.mark.parametrize("which", ["smollm2_manifest", "gemma3_manifest"])
def test_a_recipe_of_the_artifacts_passes(which: str, request: pytest.FixtureRequest) -> None:
    manifest: ArtifactManifest = request.getfixturevalue(which)
    output = next(t for t in manifest.tensors if t.layer is None and t.name.endswith(".weight"))
    recipe = Recipe(**fields(manifest, tensor_types={output.name: output.dtype}))
    recipe.check(manifest)
    assert recipe.n_layer == manifest.n_layer
    assert recipe.stage_of("b").layers.first == manifest.n_layer // 3
    assert recipe.id.startswith("split-3@") and len(recipe.id) <= 128  # the descriptor's field


def test_an_absent_quantization_is_refused_by_name(smollm2_manifest: ArtifactManifest) -> None:
    recipe = Recipe(**fields(smollm2_manifest, quantization="Q8_K"))
    with pytest.raises(UnknownQuantization, match=r"'Q8_K'.*Q4_1") as info:
        recipe.check(smollm2_manifest)
    assert info.value.field == "quantization" and info.value.name == "Q8_K"


def test_a_type_only_a_non_block_tensor_has_is_no_quantization(
    smollm2_manifest: ArtifactManifest,
) -> None:
    # SmolLM2's only Q8_0 tensor is the token embedding: not a block weight matrix
    assert any(t.dtype == "Q8_0" and t.layer is None for t in smollm2_manifest.tensors)
    with pytest.raises(UnknownQuantization, match="Q8_0"):
        Recipe(**fields(smollm2_manifest, quantization="Q8_0")).check(smollm2_manifest)


def test_an_absent_tensor_is_refused_by_name(smollm2_manifest: ArtifactManifest) -> None:
    recipe = Recipe(**fields(smollm2_manifest, tensor_types={"blk.30.attn_q.weight": "Q4_1"}))
    with pytest.raises(UnknownTensor, match=r"'blk.30.attn_q.weight'") as info:
        recipe.check(smollm2_manifest)
    assert info.value.name == "blk.30.attn_q.weight"


def test_a_tensor_of_another_type_is_refused_by_name(smollm2_manifest: ArtifactManifest) -> None:
    recipe = Recipe(**fields(smollm2_manifest, tensor_types={"blk.0.attn_q.weight": "Q6_K"}))
    with pytest.raises(TensorTypeMismatch, match=r"'blk.0.attn_q.weight'.*Q4_1.*Q6_K"):
        recipe.check(smollm2_manifest)


def test_a_recipe_for_another_model_is_refused(
    smollm2_manifest: ArtifactManifest, gemma3_manifest: ArtifactManifest
) -> None:
    recipe = Recipe(**fields(smollm2_manifest))
    with pytest.raises(WrongModel, match="model_fingerprint"):
        recipe.check(gemma3_manifest)
    stale = Recipe(**fields(smollm2_manifest, manifest_sha256="0" * 64))
    with pytest.raises(WrongModel, match="manifest_sha256"):
        stale.check(smollm2_manifest)


def test_ranges_must_cover_the_model(
    smollm2_manifest: ArtifactManifest, gemma3_manifest: ArtifactManifest
) -> None:
    # a recipe of 18 layers (gemma3's count) against SmolLM2's 30
    short = fields(gemma3_manifest)
    recipe = Recipe(**{**fields(smollm2_manifest), "stages": short["stages"]})
    with pytest.raises(LayerCoverage, match="ends at 18; the model has 30"):
        recipe.check(smollm2_manifest)


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([{"node": "a", "layers": {"first": 1, "last": 30}}], "starts at layer 1"),
        (
            [
                {"node": "a", "layers": {"first": 0, "last": 10}},
                {"node": "b", "layers": {"first": 12, "last": 30}},
            ],
            "a gap between a",
        ),
        (
            [
                {"node": "a", "layers": {"first": 0, "last": 12}},
                {"node": "b", "layers": {"first": 10, "last": 30}},
            ],
            "an overlap between a",
        ),
        (
            [
                {"node": "a", "layers": {"first": 0, "last": 10}},
                {"node": "a", "layers": {"first": 10, "last": 30}},
            ],
            "node 'a' serves more than one stage",
        ),
        ([{"node": "a", "layers": {"first": 5, "last": 5}}], "must be below last"),
        ([{"node": "bad name", "layers": {"first": 0, "last": 30}}], "node"),
        ([], "at least 1"),
    ],
)
def test_malformed_stages_are_refused(
    smollm2_manifest: ArtifactManifest, stages: list[dict[str, Any]], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        Recipe(**fields(smollm2_manifest, stages=stages))


def test_unknown_fields_and_wire_dtypes_are_refused(smollm2_manifest: ArtifactManifest) -> None:
    with pytest.raises(ValidationError, match="wire_dtype"):
        Recipe(**fields(smollm2_manifest, wire_dtype="f64"))
    with pytest.raises(ValidationError, match="placement_hint"):
        Recipe(**fields(smollm2_manifest, placement_hint="fast"))


def test_a_recipe_file_is_read_and_checked(
    smollm2_manifest: ArtifactManifest, tmp_path: Path
) -> None:
    path = tmp_path / "recipe.json"
    body = fields(smollm2_manifest, quantization="Q5_K")
    path.write_text(json.dumps(body))
    with pytest.raises(UnknownQuantization, match="Q5_K"):
        load_recipe(path).check(smollm2_manifest)
    path.write_text(json.dumps({**body, "stages": "0:30"}))
    with pytest.raises(ValidationError, match="stages"):
        load_recipe(path)
