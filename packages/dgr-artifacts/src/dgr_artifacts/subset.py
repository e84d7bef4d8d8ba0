"""Which tensors, files and bytes a shard that owns layers [first, last) needs.

Embedding at the head (first == 0); output norm and head at the tail (last == n_layer), and the
token embedding there too when the model ties its output to it. Layers past n_layer (MTP/nextn)
belong to no main range. Other global tensors (rope factors, ...) go to every stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from dgr_artifacts.errors import LayerRangeError
from dgr_artifacts.manifest import ArtifactManifest, TensorEntry

HEAD_TENSORS = ("token_embd.",)
TAIL_TENSORS = ("output_norm.", "output.")


@dataclass(frozen=True)
class RangeSubset:
    first: int
    last: int
    tensors: list[TensorEntry]
    bytes_per_file: dict[str, int]

    @property
    def files(self) -> list[str]:
        return sorted(self.bytes_per_file)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_per_file.values())


def check_range(manifest: ArtifactManifest, first: int, last: int) -> None:
    if not 0 <= first < last <= manifest.n_layer:
        raise LayerRangeError(
            manifest.arch,
            f"layer range [{first}, {last}) is not inside [0, {manifest.n_layer})"
            " with first < last",
        )


def wanted(t: TensorEntry, first: int, last: int, n_layer: int, tied_output: bool) -> bool:
    if t.layer is not None:
        return first <= t.layer < last
    if t.name.startswith(HEAD_TENSORS):
        return first == 0 or (tied_output and last == n_layer)
    if t.name.startswith(TAIL_TENSORS):
        return last == n_layer
    return True


def range_subset(manifest: ArtifactManifest, first: int, last: int) -> RangeSubset:
    check_range(manifest, first, last)
    tied = not any(t.name.startswith("output.") for t in manifest.tensors)
    chosen = [t for t in manifest.tensors if wanted(t, first, last, manifest.n_layer, tied)]
    per_file: dict[str, int] = {}
    for t in chosen:
        per_file[t.file] = per_file.get(t.file, 0) + t.nbytes
    return RangeSubset(first, last, chosen, per_file)
