"""Typed errors for model artifacts; each names the file and the cause."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)


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


class RecipeFileError(ArtifactError):
    """A recipe file that is missing, unreadable, not JSON or not a recipe."""


class LayerRangeError(ArtifactError):
    pass


class ProvisionError(ArtifactError):
    pass


class ForbiddenStorageRoot(ProvisionError):
    pass


class InsufficientSpace(ProvisionError):
    pass


def problems(exc: ValidationError, limit: int = 6) -> str:
    """A pydantic ValidationError as a person reads it: each problem as `where: what` (the
    field's dotted path, pydantic's message less its "Value error, " prefix), one per line after
    the first, at most `limit`; not pydantic's dump of the input with its documentation links."""
    lines = []
    for error in exc.errors()[:limit]:
        where = ".".join(str(p) for p in error["loc"])
        what = str(error["msg"]).removeprefix("Value error, ")
        lines.append(f"{where}: {what}" if where else what)
    if exc.error_count() > limit:
        lines.append(f"... and {exc.error_count() - limit} more")
    if exc.error_count() == 1:
        return lines[0]
    return f"{exc.error_count()} problems:\n  " + "\n  ".join(lines)


def read_model(
    path: Path, model: type[Model], error: type[ArtifactError], kind: str, what: str
) -> Model:
    """The JSON `model` (a manifest, a recipe) at `path`, or `error` naming the file and what is
    wrong with it: missing, unreadable or not UTF-8, or each field's problem by its path. `kind`
    names the file ("no such recipe file"), `what` the document ("not a recipe: ...")."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(path, f"no such {kind} file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(path, f"cannot read it as a JSON {kind}: {exc}") from None
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        raise error(path, f"not {what}: {problems(exc)}") from None
