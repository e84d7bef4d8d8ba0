"""Where the fetched and patched llama.cpp trees live: $DGR_NATIVE_WORKSPACE, by default
$DGR_CACHE/native, outside version control."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dgr_artifacts.downloads import cache_dir
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
    # Machine-wide, outside any checkout: every clone shares one verified tree and one build
    # directory per commit and lane, so a fresh clone (CI) rebuilds nothing that did not change.
    root = Path(os.environ.get("DGR_NATIVE_WORKSPACE", cache_dir() / "native"))
    return NativeWorkspace(repo=repo, pin=load_pin(repo.llama_manifest), root=root)
