"""Resumable verification of model files against a manifest's chunk hashes.

State lives in `<state_dir>/<file>.verify.json` and is replaced atomically after every chunk, so a
verification killed at any moment (SIGKILL included) resumes from the last verified chunk and
reaches the same verdict. A flipped byte is reported with its file, chunk index and byte range.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dgr_artifacts.errors import ArtifactError
from dgr_artifacts.manifest import ArtifactManifest, FileEntry
from dgr_artifacts.progress import Progress


@dataclass(frozen=True)
class BadChunk:
    file: str
    index: int
    start: int
    end: int

    def __str__(self) -> str:
        return f"{self.file}: chunk {self.index} (bytes {self.start}..{self.end - 1}) differs"


@dataclass
class VerifyReport:
    ok: bool = True
    bad: list[BadChunk] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    bytes_hashed: int = 0
    resumed_chunks: int = 0


def _state_path(state_dir: Path, name: str) -> Path:
    return state_dir / f"{name}.verify.json"


def _load_state(path: Path, identity: dict[str, Any]) -> dict[str, Any] | None:
    try:
        state: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return state if state.get("identity") == identity else None


def _save_state(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state), encoding="utf-8")
    os.replace(tmp, path)


def verify_file(
    entry: FileEntry,
    path: Path,
    state_dir: Path,
    manifest_digest: str,
    report: VerifyReport,
    progress: Progress | None = None,
) -> None:
    if not path.is_file():
        report.problems.append(f"{entry.name}: missing at {path}")
        return
    stat = path.stat()
    if stat.st_size != entry.size:
        report.problems.append(f"{entry.name}: size {stat.st_size}, manifest says {entry.size}")
        return
    identity = {
        "manifest": manifest_digest,
        "file": entry.name,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "chunk_size": entry.chunk_size,
    }
    state_file = _state_path(state_dir, entry.name)
    state = _load_state(state_file, identity) or {"identity": identity, "next": 0, "bad": []}
    start = int(state["next"])
    report.resumed_chunks += start
    buf = bytearray(entry.chunk_size)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as fh:
        fh.seek(start * entry.chunk_size)
        for index in range(start, len(entry.chunk_sha256)):
            n = fh.readinto(buf)
            if hashlib.sha256(view[:n]).hexdigest() != entry.chunk_sha256[index]:
                state["bad"].append(index)
            report.bytes_hashed += n
            state["next"] = index + 1
            _save_state(state_file, state)
            if progress:
                progress.update(progress.done + n)
    for index in state["bad"]:
        lo = index * entry.chunk_size
        report.bad.append(BadChunk(entry.name, index, lo, min(lo + entry.chunk_size, entry.size)))


def verify(
    manifest: ArtifactManifest,
    model_dir: Path,
    state_dir: Path | None = None,
    progress: Progress | None = None,
    fresh: bool = False,
) -> VerifyReport:
    """Verify every file of the manifest under `model_dir`; resume from saved state."""
    if not model_dir.is_dir():
        raise ArtifactError(model_dir, "no such model directory")
    state_dir = state_dir or model_dir / ".dgr-verify"
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ArtifactError(state_dir, f"cannot keep verification state: {exc.strerror}") from exc
    digest = manifest.digest()
    report = VerifyReport()
    for entry in manifest.files:
        if fresh:
            _state_path(state_dir, entry.name).unlink(missing_ok=True)
        verify_file(entry, model_dir / entry.name, state_dir, digest, report, progress)
    report.ok = not report.bad and not report.problems
    if progress:
        progress.finish()
    return report
