"""native/llama.cpp/manifest.json: the one place the llama.cpp pin is written down."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Commit = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{40}$")]


class PypiSdistSource(BaseModel):
    """The llama.cpp tree as vendored inside a PyPI sdist (reachable where git hosts are not)."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["pypi-sdist"] = "pypi-sdist"
    package: str
    version: str
    filename: str
    size: int = Field(gt=0)
    sha256: Sha256
    subdir: str = Field(description="Directory inside the archive's top folder holding the tree.")


class GitSource(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["git"] = "git"
    url: str
    commit: Commit


class Lineage(BaseModel):
    """How the pinned tree relates to the upstream change that brought an architecture in."""

    model_config = ConfigDict(extra="forbid")
    arch: str = Field(description="The LLM_ARCH name the change added.")
    pull_request: int = Field(gt=0)
    merge: Commit = Field(description="The merge commit of that pull request.")
    relation: Literal["same", "descendant", "not-yet"] = Field(
        description="The pinned commit is that merge, comes after it, or predates it."
    )
    evidence: str = Field(min_length=1, description="How the relation was established.")
    patches_add: str = Field(
        min_length=1, description="What DGR's patches carry for this arch that the merge lacks."
    )


class LlamaPin(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: int = 1
    upstream: str
    commit: Commit
    release: str
    tree_sha256: Sha256 = Field(description="dgr_llamacpp.tree.tree_hash of the extracted tree.")
    sources: list[Annotated[PypiSdistSource | GitSource, Field(discriminator="kind")]] = Field(
        min_length=1
    )
    required_archs: list[str] = Field(
        default_factory=list, description="LLM_ARCH names the pinned tree must carry."
    )
    lineage: list[Lineage] = Field(
        default_factory=list,
        description="Upstream changes the target models depend on, and the pin's relation to each.",
    )

    def sdist(self) -> PypiSdistSource:
        for source in self.sources:
            if isinstance(source, PypiSdistSource):
                return source
        raise LookupError("the manifest names no pypi-sdist source")


def load_pin(path: Path) -> LlamaPin:
    return LlamaPin.model_validate_json(path.read_text(encoding="utf-8"))


def schema_models() -> dict[str, type[BaseModel]]:
    return {"llama-pin.schema.json": LlamaPin}
