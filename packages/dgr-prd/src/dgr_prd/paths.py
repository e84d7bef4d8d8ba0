"""Where the monorepo's planning files live, found from the repository root."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dgr_records import checkout


@dataclass(frozen=True)
class RepoPaths:
    root: Path

    @property
    def prd(self) -> Path:
        return self.root / "prd.json"

    @property
    def prd_md(self) -> Path:
        return self.root / "PRD.md"

    @property
    def ralph(self) -> Path:
        return self.root / "RALPH-CONTEXT.md"

    @property
    def stories(self) -> Path:
        return self.root / "stories"

    @property
    def schemas(self) -> Path:
        return self.root / "schemas"

    @property
    def evidence(self) -> Path:
        return self.root / "evidence"

    @property
    def docs(self) -> Path:
        return self.root / "docs"

    @property
    def generated_docs(self) -> Path:
        return self.docs / "generated"

    @property
    def llama_manifest(self) -> Path:
        return self.root / "native" / "llama.cpp" / "manifest.json"

    @property
    def patches(self) -> Path:
        return self.root / "native" / "llama.cpp" / "patches"


def find_root(start: Path | None = None) -> RepoPaths:
    """The nearest directory at or above `start` (default: cwd) that holds prd.json.

    DGR_REPO_ROOT overrides the search, which lets tests run the tools on a copy of the repo.
    """
    root = checkout(start)
    if root is None:
        here = (start or Path.cwd()).resolve()
        raise FileNotFoundError(f"no prd.json at or above {here}; run from the DGR repository")
    return RepoPaths(root)
