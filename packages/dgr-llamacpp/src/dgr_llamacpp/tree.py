"""A content hash of a source tree that is the same on every machine and filesystem."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

IGNORED_NAMES = {".dgr-stamp.json", "__pycache__", ".git"}


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tree_hash(root: Path) -> str:
    """sha256 over (relative path, kind, executable bit, content hash) of every entry, sorted.

    Directory entries and timestamps do not count; symlinks count by their target text.
    """
    entries: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in IGNORED_NAMES)
        for name in filenames:
            if name in IGNORED_NAMES:
                continue
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                entries.append(f"{rel}\0link\0-\0{os.readlink(path)}")
            else:
                executable = "x" if os.access(path, os.X_OK) else "-"
                entries.append(f"{rel}\0file\0{executable}\0{file_sha256(path)}")
    digest = hashlib.sha256()
    for entry in sorted(entries):
        digest.update(entry.encode("utf-8") + b"\n")
    return digest.hexdigest()
