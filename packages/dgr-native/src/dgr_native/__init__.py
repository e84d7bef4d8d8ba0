"""DGR ShardEngine for Python: `load()` builds (if needed) and imports the engine module.

The engine is C++ (native/engine) over patched libllama; `Engine` takes numpy buffers in place
and releases the GIL while llama.cpp computes. Failures raise `ShardError` with a `.status`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

from dgr_native.build import build_engine

_module: ModuleType | None = None


def load(lane: str = "cpu") -> ModuleType:
    """The `_dgr_engine` extension, built for `lane` when missing or stale (a no-op otherwise)."""
    global _module
    if _module is None:
        path: Path = build_engine(lane)
        spec = importlib.util.spec_from_file_location("_dgr_engine", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load the engine module from {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _module = module
    return _module


def build_info() -> dict[str, Any]:
    """What the engine module was built from, compiled into it: llama.cpp commit, patch stack
    hash, lane and wire schema version (`dgr --version` prints it)."""
    return dict(load().build_info())
