"""A recipe (DGR-056): the artifact manifest it was made for, the quantization, the layer range
each node serves and the wire dtype. Quantization and placement are inputs, never constants: a
recipe is checked against the manifest of the model it names, and anything it names that the
artifacts lack is refused by name.

`quantization` is the ggml type of the model's block weight matrices (the 2-D `blk.N.*`
tensors), as the manifest lists it, e.g. "Q4_1" or "Q4_K"; `tensor_types` may pin single
tensors to a type ("output.weight": "Q6_K"). Both must be what the file holds: DGR does not
requantize.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Literal

from dgr_wire.ranges import LayerRange
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)

from dgr_artifacts.errors import RecipeFileError, read_model
from dgr_artifacts.manifest import ArtifactManifest

RECIPE_VERSION: Literal["1.0"] = "1.0"
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
Hex64 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
GgmlType = Annotated[str, StringConstraints(pattern=r"^[A-Z0-9_]{2,16}$")]
WireDtype = Literal["f32", "f16", "bf16"]


class RecipeError(ValueError):
    """A recipe that does not fit its artifacts; `field` and `name` say what is wrong."""

    def __init__(self, field: str, name: str, detail: str) -> None:
        self.field, self.name = field, name
        super().__init__(f"recipe {field} {name!r}: {detail}")


class WrongModel(RecipeError):
    pass


class UnknownQuantization(RecipeError):
    pass


class UnknownTensor(RecipeError):
    pass


class TensorTypeMismatch(RecipeError):
    pass


class LayerCoverage(RecipeError):
    pass


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class StagePlacement(_Strict):
    """One stage: the node that serves it and its layers."""

    node: Name
    layers: LayerRange


class Recipe(_Strict):
    """Which model, at which quantization, split how, over which wire dtype."""

    recipe_version: Literal["1.0"] = RECIPE_VERSION
    name: Name
    model_fingerprint: Hex64 = Field(description="dgr-artifacts fingerprint of the GGUF")
    manifest_sha256: Hex64 = Field(description="digest of the artifact manifest it was made for")
    quantization: GgmlType = Field(description="ggml type of the block weight matrices")
    tensor_types: dict[str, GgmlType] = Field(
        default_factory=dict, max_length=4096, description="tensor name -> the ggml type it has"
    )
    wire_dtype: WireDtype
    stages: list[StagePlacement] = Field(min_length=1, max_length=256)

    @model_validator(mode="after")
    def _contiguous(self) -> Recipe:
        if self.stages[0].layers.first != 0:
            raise ValueError(
                f"the first stage starts at layer {self.stages[0].layers.first}, not 0"
            )
        for a, b in zip(self.stages, self.stages[1:], strict=False):
            if a.layers.last != b.layers.first:
                what = "a gap" if a.layers.last < b.layers.first else "an overlap"
                raise ValueError(f"{what} between {a.node} ({a.layers}) and {b.node} ({b.layers})")
        nodes = [s.node for s in self.stages]
        for n in nodes:
            if nodes.count(n) > 1:
                raise ValueError(f"node {n!r} serves more than one stage")
        return self

    @property
    def n_layer(self) -> int:
        return self.stages[-1].layers.last

    def digest(self) -> str:
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @property
    def id(self) -> str:
        """What a worker's compatibility descriptor carries as its recipe."""
        return f"{self.name}@{self.digest()[:16]}"

    def stage_of(self, node: str) -> StagePlacement:
        for stage in self.stages:
            if stage.node == node:
                return stage
        raise RecipeError("node", node, f"is not in the recipe ({[s.node for s in self.stages]})")

    def check(self, manifest: ArtifactManifest) -> None:
        """Refuse, by name, anything this recipe needs that the artifacts do not hold."""
        if self.model_fingerprint != manifest.model_fingerprint:
            raise WrongModel(
                "model_fingerprint",
                self.model_fingerprint,
                f"the manifest is of model {manifest.model_fingerprint}",
            )
        if self.manifest_sha256 != manifest.digest():
            raise WrongModel(
                "manifest_sha256", self.manifest_sha256, f"the manifest's is {manifest.digest()}"
            )
        if self.n_layer != manifest.n_layer:
            raise LayerCoverage(
                "stages",
                str(self.stages[-1].layers),
                f"the last stage ends at {self.n_layer}; the model has {manifest.n_layer} layers",
            )
        matrices = sorted(
            {t.dtype for t in manifest.tensors if t.layer is not None and len(t.shape) >= 2}
        )
        if self.quantization not in matrices:
            raise UnknownQuantization(
                "quantization",
                self.quantization,
                f"no block weight matrix of this model has it (they are {', '.join(matrices)})",
            )
        by_name = {t.name: t for t in manifest.tensors}
        for name, dtype in sorted(self.tensor_types.items()):
            tensor = by_name.get(name)
            if tensor is None:
                raise UnknownTensor("tensor_types", name, "is not a tensor of this model")
            if tensor.dtype != dtype:
                raise TensorTypeMismatch(
                    "tensor_types", name, f"is {tensor.dtype} in the artifacts, not {dtype}"
                )


def load_recipe(path: Path) -> Recipe:
    """The recipe at `path` (as `dgr plan --recipe-out` writes it), or RecipeFileError naming the
    file and what is wrong with it: each field's problem by its path."""
    return read_model(path, Recipe, RecipeFileError, "recipe", "a recipe")


def write_recipe(recipe: Recipe, path: Path) -> None:
    path.write_text(json.dumps(recipe.model_dump(mode="json"), indent=1) + "\n", "utf-8")


def schema_models() -> dict[str, type[BaseModel]]:
    return {"recipe.schema.json": Recipe}


def main_quantization(manifest: ArtifactManifest) -> str:
    """The ggml type holding most bytes of the block weight matrices."""
    totals: dict[str, int] = {}
    for t in manifest.tensors:
        if t.layer is not None and len(t.shape) >= 2:
            totals[t.dtype] = totals.get(t.dtype, 0) + t.nbytes
    return max(sorted(totals), key=lambda k: totals[k])
