"""The hashed manifest: schema, every tensor once, offsets and hashes that match the bytes."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import gguf
import jsonschema
from dgr_artifacts.identity import open_model, tensor_sha256
from dgr_artifacts.manifest import ArtifactManifest, build_manifest, load_manifest

REPO = Path(__file__).resolve().parents[3]


def test_manifest_validates_against_the_committed_schema(manifest: ArtifactManifest) -> None:
    schema = json.loads((REPO / "schemas" / "artifact-manifest.schema.json").read_text())
    jsonschema.validate(manifest.model_dump(mode="json"), schema)


def test_files_and_tensors(manifest: ArtifactManifest, smollm2: Path) -> None:
    (entry,) = manifest.files
    assert entry.size == smollm2.stat().st_size
    assert entry.sha256 == hashlib.sha256(smollm2.read_bytes()).hexdigest()
    assert len(entry.chunk_sha256) == -(-entry.size // entry.chunk_size)
    names = [t.name for t in manifest.tensors]
    # one entry per tensor of the file, as gguf's own reader lists them
    assert sorted(names) == sorted(t.name for t in gguf.GGUFReader(smollm2).tensors)
    assert len(names) == len(set(names))
    model = open_model(smollm2)
    by_name = {t.name: t for t in model.tensors}
    for t in manifest.tensors[::17]:
        assert (
            tensor_sha256(by_name[t.name], smollm2.parent)
            == hashlib.sha256(smollm2.read_bytes()[t.offset : t.offset + t.nbytes]).hexdigest()
        )


def test_split_manifest_indexes_every_part(
    split_sets: dict[str, Path], manifest: ArtifactManifest, tmp_path: Path
) -> None:
    split = build_manifest(split_sets["tensors-60"])
    assert split.split_count == len(split.files) >= 5
    assert split.model_fingerprint == manifest.model_fingerprint
    assert sorted(t.name for t in split.tensors) == sorted(t.name for t in manifest.tensors)
    assert {t.file for t in split.tensors} == {f.name for f in split.files}
    out = tmp_path / "m.json"
    subprocess_out = (
        __import__("subprocess")
        .run(
            ["dgr", "artifacts", "manifest", str(split_sets["tensors-60"]), "--out", str(out)],
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout
    )
    assert split.model_fingerprint in subprocess_out
    assert load_manifest(out) == split


def test_a_stored_manifest_is_the_built_one_once_per_version_of_the_files(
    twin_copy: Path, tmp_path: Path, reads_no_model: Callable[[], AbstractContextManager[Any]]
) -> None:
    from dgr_artifacts.manifest import stored_manifest

    copy, store = twin_copy, tmp_path / "store"
    first = stored_manifest(copy, store)
    assert first == build_manifest(copy)
    with reads_no_model():
        assert stored_manifest(copy, store) == first
    with copy.open("ab") as fh:  # the file grows: another version, built again
        fh.write(b"\0" * 64)
    assert stored_manifest(copy, store).files[0].size == first.files[0].size + 64
