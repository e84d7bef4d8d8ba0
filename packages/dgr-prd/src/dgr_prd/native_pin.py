"""Read-only views of the native pin that evidence records carry (no dependency on the tooling)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def llama_pin(manifest: Path) -> dict[str, Any] | None:
    if not manifest.is_file():
        return None
    data: dict[str, Any] = json.loads(manifest.read_text(encoding="utf-8"))
    return data


def patch_stack_hash(patches_dir: Path) -> str | None:
    """sha256 over the numbered patch files, names and bytes, in order; None without patches."""
    patches = sorted(patches_dir.glob("*.patch")) if patches_dir.is_dir() else []
    if not patches:
        return None
    digest = hashlib.sha256()
    for patch in patches:
        digest.update(patch.name.encode() + b"\0" + patch.read_bytes() + b"\0")
    return digest.hexdigest()
