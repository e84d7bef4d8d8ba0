"""The hashed artifact manifest: every file with size, sha256 and chunk hashes, the tensor index,
and the model fingerprint. Its JSON Schema is generated from these models (schemas/)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from dgr_artifacts.errors import ManifestError, read_model
from dgr_artifacts.identity import GgufModel, fingerprint, open_model, stored

Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
DEFAULT_CHUNK = 16 * 2**20


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="File name, relative to the model directory.")
    size: int = Field(ge=0)
    sha256: Sha256
    chunk_size: int = Field(gt=0)
    chunk_sha256: list[Sha256] = Field(description="sha256 of each chunk_size slice, in order.")


class TensorEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    file: str
    offset: int = Field(ge=0, description="Absolute byte offset of the data in its file.")
    nbytes: int = Field(ge=0)
    dtype: str
    shape: list[int]
    layer: int | None = Field(description="Block index for blk.N.* tensors, else null.")


class ArtifactManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: int = 1
    model_fingerprint: Sha256
    arch: str
    n_layer: int = Field(gt=0)
    split_count: int = Field(ge=1)
    files: list[FileEntry] = Field(min_length=1)
    tensors: list[TensorEntry] = Field(min_length=1)

    def file(self, name: str) -> FileEntry:
        for entry in self.files:
            if entry.name == name:
                return entry
        raise KeyError(f"{name} is not in the manifest")

    def digest(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()


def hash_file(path: Path, chunk_size: int) -> tuple[str, list[str]]:
    whole = hashlib.sha256()
    chunks = []
    buf = bytearray(chunk_size)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as fh:
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            whole.update(view[:n])
            chunks.append(hashlib.sha256(view[:n]).hexdigest())
    return whole.hexdigest(), chunks


def build_manifest(model: GgufModel | Path, chunk_size: int = DEFAULT_CHUNK) -> ArtifactManifest:
    model = model if isinstance(model, GgufModel) else open_model(model)
    files = []
    for part in model.parts:
        sha, chunks = hash_file(part.path, chunk_size)
        files.append(
            FileEntry(
                name=part.path.name,
                size=part.size,
                sha256=sha,
                chunk_size=chunk_size,
                chunk_sha256=chunks,
            )
        )
    tensors = [
        TensorEntry(
            name=t.name,
            file=t.file,
            offset=t.offset,
            nbytes=t.nbytes,
            dtype=t.dtype,
            shape=list(t.shape),
            layer=t.layer,
        )
        for t in model.tensors
    ]
    return ArtifactManifest(
        model_fingerprint=fingerprint(model),
        arch=model.arch,
        n_layer=model.n_layer,
        split_count=len(model.parts),
        files=files,
        tensors=tensors,
    )


def stored_manifest(path: Path, store: Path | None = None) -> ArtifactManifest:
    """`build_manifest` of the model at `path`, as identity.stored keeps it (once per version
    of its files): what `dgr plan` and `dgr worker --recipe` check against, without hashing the
    whole model each time. `dgr artifacts manifest` always builds afresh."""
    value = stored(path, "manifests", lambda m: build_manifest(m).model_dump(mode="json"), store)
    return ArtifactManifest.model_validate(value)


def load_manifest(path: Path) -> ArtifactManifest:
    """The manifest at `path`, or ManifestError naming the file and what is wrong with it."""
    return read_model(path, ArtifactManifest, ManifestError, "manifest", "a DGR artifact manifest")


def write_manifest(manifest: ArtifactManifest, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest.model_dump(mode="json"), indent=1) + "\n", "utf-8")
    tmp.replace(path)


def schema_models() -> dict[str, type[BaseModel]]:
    return {"artifact-manifest.schema.json": ArtifactManifest}
