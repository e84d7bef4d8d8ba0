"""Where the fetched and patched llama.cpp trees live (ignored by git)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dgr_prd.paths import RepoPaths, find_root

from dgr_llamacpp.manifest import LlamaPin, load_pin


@dataclass(frozen=True)
class NativeWorkspace:
    repo: RepoPaths
    pin: LlamaPin
    root: Path

    @property
    def pristine(self) -> Path:
        return self.root / f"llama.cpp-{self.pin.commit[:12]}"

    @property
    def patched(self) -> Path:
        return self.root / f"llama.cpp-{self.pin.commit[:12]}-patched"

    @property
    def patches(self) -> Path:
        return self.repo.patches


def open_workspace(repo: RepoPaths | None = None) -> NativeWorkspace:
    repo = repo or find_root()
    root = Path(os.environ.get("DGR_NATIVE_WORKSPACE", repo.root / "native" / "workspace"))
    return NativeWorkspace(repo=repo, pin=load_pin(repo.llama_manifest), root=root)
