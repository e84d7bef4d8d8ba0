"""Range subsets over the real model and split sets made by gguf-split."""

from __future__ import annotations

from pathlib import Path

import pytest
from dgr_artifacts.errors import LayerRangeError
from dgr_artifacts.manifest import ArtifactManifest, build_manifest
from dgr_artifacts.subset import range_subset

PARTITIONS = [
    [(0, 30)],
    [(0, 10), (10, 20), (20, 30)],
    [(0, 1), (1, 2), (2, 29), (29, 30)],
    [(0, 6), (6, 12), (12, 18), (18, 24), (24, 30)],
]
SHARED = {"token_embd.weight"}  # SmolLM2 ties its output head to the embedding


@pytest.fixture(scope="module")
def manifests(
    manifest: ArtifactManifest, split_sets: dict[str, Path]
) -> dict[str, ArtifactManifest]:
    return {"single": manifest, **{k: build_manifest(v) for k, v in split_sets.items()}}


@pytest.mark.parametrize("partition", PARTITIONS, ids=lambda p: f"{len(p)}-stages")
def test_partition_covers_every_tensor(
    manifests: dict[str, ArtifactManifest], partition: list[tuple[int, int]]
) -> None:
    for name, manifest in manifests.items():
        subsets = [range_subset(manifest, a, b) for a, b in partition]
        seen: dict[str, int] = {}
        for sub in subsets:
            for t in sub.tensors:
                seen[t.name] = seen.get(t.name, 0) + 1
            assert sub.files == sorted({t.file for t in sub.tensors}), name
            assert sub.total_bytes == sum(t.nbytes for t in sub.tensors)
        assert set(seen) == {t.name for t in manifest.tensors}, name
        assert {k for k, v in seen.items() if v > 1} == (SHARED if len(partition) > 1 else set())


def test_head_middle_tail(manifest: ArtifactManifest) -> None:
    head, middle, tail = (range_subset(manifest, a, b) for a, b in [(0, 10), (10, 20), (20, 30)])
    names = [{t.name for t in s.tensors} for s in (head, middle, tail)]
    assert "token_embd.weight" in names[0] and "output_norm.weight" not in names[0]
    assert not {"token_embd.weight", "output_norm.weight"} & names[1]
    assert {"token_embd.weight", "output_norm.weight"} <= names[2]
    # exactly the tensors of layers 10..19, each once, and nothing shared
    assert sorted(t.name for t in middle.tensors) == sorted(
        t.name for t in manifest.tensors if t.layer is not None and 10 <= t.layer < 20
    )


def test_split_files_are_only_those_a_range_needs(manifests: dict[str, ArtifactManifest]) -> None:
    split = manifests["tensors-60"]
    middle = range_subset(split, 12, 14)
    assert 1 <= len(middle.files) < len(split.files)


@pytest.mark.parametrize("first,last", [(5, 5), (-1, 3), (0, 31), (20, 10)])
def test_bad_ranges_are_typed_errors(manifest: ArtifactManifest, first: int, last: int) -> None:
    with pytest.raises(LayerRangeError, match=rf"\[{first}, {last}\) is not inside \[0, 30\)"):
        range_subset(manifest, first, last)


def test_a_shard_provisions_only_its_files(
    split_sets: dict[str, Path], manifests: dict[str, ArtifactManifest], tmp_path: Path
) -> None:
    import subprocess

    from dgr_artifacts.manifest import write_manifest

    split = manifests["tensors-60"]
    manifest_path = tmp_path / "manifest.json"
    write_manifest(split, manifest_path)
    root = tmp_path / "store"
    subprocess.run(
        [
            "dgr",
            "artifacts",
            "provision",
            str(manifest_path),
            "--source",
            str(split_sets["tensors-60"].parent),
            "--root",
            str(root),
            "--layers",
            "12:14",
        ],
        check=True,
        capture_output=True,
    )
    assert sorted(p.name for p in root.iterdir()) == range_subset(split, 12, 14).files
