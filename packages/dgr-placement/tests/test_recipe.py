"""DGR-056: a recipe names its model's manifest, a quantization, per-node layer ranges and a wire
dtype; checked against the real artifact manifests, anything the artifacts lack is refused by
name."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from dgr_artifacts.errors import RecipeFileError
from dgr_artifacts.manifest import ArtifactManifest, build_manifest
from dgr_artifacts.models import model_path
from dgr_artifacts.recipe import (
    LayerCoverage,
    Recipe,
    TensorTypeMismatch,
    UnknownQuantization,
    UnknownTensor,
    WrongModel,
    load_recipe,
    main_quantization,
    write_recipe,
)
from dgr_meshnet.collect import descriptor
from dgr_route.route import Route, RouteError
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
    with pytest.raises(
        RecipeFileError, match=r"recipe.json: not a recipe: stages: Input should be"
    ):
        load_recipe(path)
    path.write_text("{")
    with pytest.raises(RecipeFileError, match="not a recipe: Invalid JSON"):
        load_recipe(path)
    with pytest.raises(RecipeFileError, match=r"nothing\.json: no such recipe file"):
        load_recipe(tmp_path / "nothing.json")


def start_dgr_worker(*args: str) -> tuple[subprocess.Popen[str], str]:
    """`dgr worker ... --listen 127.0.0.1:0` as a user runs it; (process, address) once ready."""
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "dgr"), "worker", *args, "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("DGR-WORKER-READY port="):
            return proc, f"127.0.0.1:{int(line.split('=', 1)[1])}"
    proc.wait()
    raise AssertionError(f"worker exited {proc.returncode}: {''.join(lines[-10:])}")


@pytest.mark.fleet
def test_a_worker_serves_its_node_of_a_recipe(
    smollm2: Path, smollm2_manifest: ArtifactManifest, tmp_path: Path
) -> None:
    recipe = Recipe(**fields(smollm2_manifest))
    path = tmp_path / "recipe.json"
    write_recipe(recipe, path)
    common = ["--model", str(smollm2), "--n-ctx", "64", "--max-sessions", "1", "--threads", "1"]
    started = [start_dgr_worker(*common, "--recipe", str(path), "--node", n) for n in "abc"]
    plain = None
    try:
        addresses = [address for _, address in started]
        assert all(descriptor(address).recipe == recipe.id for address in addresses)
        route = Route.open(addresses)
        assert [s.layers for s in route.stages] == [s.layers for s in recipe.stages]
        assert len(list(route.generate([1000, 1001, 1002], 3))) == 3
        route.close()
        # a worker without the recipe may not join a route of workers serving it
        plain, plain_address = start_dgr_worker(*common, "--layers", "20:30")
        with pytest.raises(RouteError, match=r"incompatible descriptor field recipe: ''"):
            Route.open([*addresses[:2], plain_address])
    finally:
        for proc in [p for p, _ in started] + ([plain] if plain else []):
            proc.terminate()
            proc.wait(20)


@pytest.mark.fleet
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--node", "z"], r"node 'z': is not in the recipe"),
        (["--node", "a", "--layers", "0:5"], r"--layers 0:5 is not node a's 0:10"),
        ([], "--recipe needs --node"),
        (["--node", "a", "--other-model"], "model_fingerprint"),
    ],
)
def test_a_worker_refuses_a_recipe_that_does_not_fit(
    smollm2: Path,
    smollm2_manifest: ArtifactManifest,
    tmp_path: Path,
    extra: list[str],
    message: str,
) -> None:
    path = tmp_path / "recipe.json"
    write_recipe(Recipe(**fields(smollm2_manifest)), path)
    model = str(smollm2)
    if "--other-model" in extra:
        extra = [e for e in extra if e != "--other-model"]
        model = str(model_path("gemma3-270m-q4_k_m"))
    out = subprocess.run(
        [
            str(Path(sys.executable).parent / "dgr"),
            "worker",
            "--model",
            model,
            "--recipe",
            str(path),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert re.search(message, out.stderr), out.stderr


@pytest.mark.fleet
def test_the_worker_binary_validates_the_recipe_id(smollm2: Path) -> None:
    from dgr_native.build import worker_binary

    out = subprocess.run(
        [
            str(worker_binary()),
            "--model",
            str(smollm2),
            "--layers",
            "0:30",
            "--recipe-id",
            "bad id\n",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--recipe-id: bad id" in out.stderr and "[A-Za-z0-9._@-]" in out.stderr
