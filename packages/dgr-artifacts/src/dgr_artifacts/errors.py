"""Typed errors for model artifacts; each names the file and the cause."""

from __future__ import annotations

from pathlib import Path


class ArtifactError(Exception):
    def __init__(self, path: Path | str, cause: str) -> None:
        self.path = Path(path)
        self.cause = cause
        super().__init__(f"{path}: {cause}")


class CorruptGguf(ArtifactError):
    pass


class TruncatedGguf(CorruptGguf):
    pass


class BadMagic(ArtifactError):
    pass


class UnsupportedGgufVersion(ArtifactError):
    pass


class IncompleteSplit(ArtifactError):
    pass


class DuplicateSplitPart(ArtifactError):
    pass


class HashMismatch(ArtifactError):
    pass


class ManifestError(ArtifactError):
    """A manifest file that is missing, unreadable or not a DGR artifact manifest."""


class LayerRangeError(ArtifactError):
    pass


class ProvisionError(ArtifactError):
    pass


class ForbiddenStorageRoot(ProvisionError):
    pass


class InsufficientSpace(ProvisionError):
    pass
