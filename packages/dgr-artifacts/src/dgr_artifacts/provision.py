"""Provision model files from a source into a storage root: checked, resumable, atomic.

Per file: a good file already in place is kept; otherwise bytes go to `.<name>.part` (resumed
from its length, with an HTTP Range request or a seek), are fsynced, verified chunk by chunk
against the manifest, and only then renamed to the final name. A failure never leaves a partial
or unverified file under the final name.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from dgr_artifacts.errors import (
    ForbiddenStorageRoot,
    HashMismatch,
    InsufficientSpace,
    ProvisionError,
)
from dgr_artifacts.manifest import ArtifactManifest, FileEntry
from dgr_artifacts.progress import Progress

BLOCK = 1 << 20
DEFAULT_FORBIDDEN = (Path("/home"),)


@dataclass(frozen=True)
class StoragePolicy:
    root: Path
    forbidden: tuple[Path, ...] = DEFAULT_FORBIDDEN

    def check(self) -> Path:
        root = self.root.expanduser().resolve()
        for bad in self.forbidden:
            bad = bad.resolve()
            if root == bad or bad in root.parents:
                raise ForbiddenStorageRoot(
                    root,
                    f"storage root is under {bad}, which the "
                    "storage policy forbids for model artifacts",
                )
        return root


@dataclass
class ProvisionReport:
    kept: list[str] = field(default_factory=list)
    fetched: list[str] = field(default_factory=list)
    bytes_copied: int = 0
    resumed_bytes: int = 0


def _chunks_match(path: Path, entry: FileEntry) -> int | None:
    """Index of the first chunk that differs from the manifest, or None when all match."""
    with path.open("rb") as fh:
        for index, expected in enumerate(entry.chunk_sha256):
            if hashlib.sha256(fh.read(entry.chunk_size)).hexdigest() != expected:
                return index
        if fh.read(1):
            return len(entry.chunk_sha256)
    return None


def _open_source(source: str, name: str, offset: int) -> tuple[BinaryIO, int]:
    """Open `name` at `source` from byte `offset`; returns (stream, offset actually served)."""
    parsed = urllib.parse.urlparse(source)
    if parsed.scheme in ("http", "https"):
        url = source.rstrip("/") + "/" + urllib.parse.quote(name)
        request = urllib.request.Request(
            url, headers={"Range": f"bytes={offset}-"} if offset else {}
        )
        try:
            response = urllib.request.urlopen(request, timeout=60)
        except OSError as exc:
            raise ProvisionError(name, f"cannot fetch {url}: {exc}") from exc
        served = offset if response.status == 206 else 0
        return response, served
    base = (
        Path(urllib.request.url2pathname(parsed.path)) if parsed.scheme == "file" else Path(source)
    )
    try:
        stream = (base / name).open("rb")
    except OSError as exc:
        raise ProvisionError(base / name, f"cannot read source: {exc.strerror}") from exc
    stream.seek(offset)
    return stream, offset


def _blocks(stream: BinaryIO) -> Iterator[bytes]:
    while block := stream.read(BLOCK):
        yield block


def write_stream(
    part: Path, blocks: Iterator[bytes], append: bool, progress: Progress | None = None
) -> int:
    """Write blocks into `part` and fsync; disk-full and read-only become ProvisionErrors."""
    written = 0
    try:
        with part.open("ab" if append else "wb") as out:
            for block in blocks:
                out.write(block)
                written += len(block)
                if progress:
                    progress.update(progress.done + len(block))
            out.flush()
            os.fsync(out.fileno())
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise ProvisionError(
                part,
                "disk full while writing; the partial file stays for a resume once space is freed",
            ) from exc
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise ProvisionError(part, f"target is not writable ({exc.strerror})") from exc
        raise ProvisionError(part, f"write failed: {exc.strerror}") from exc
    return written


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def provision(
    manifest: ArtifactManifest,
    source: str,
    policy: StoragePolicy,
    only: list[str] | None = None,
    progress: Progress | None = None,
) -> ProvisionReport:
    """Make every manifest file (or those named in `only`) present and verified in the root."""
    root = policy.check()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ProvisionError(root, f"cannot create storage root: {exc.strerror}") from exc
    report = ProvisionReport()
    todo = []
    for entry in manifest.files:
        if only is not None and entry.name not in only:
            continue
        final = root / entry.name
        if (
            final.is_file()
            and final.stat().st_size == entry.size
            and _chunks_match(final, entry) is None
        ):
            report.kept.append(entry.name)
        else:
            todo.append(entry)
    part_sizes = {
        e.name: _part(root, e).stat().st_size if _part(root, e).is_file() else 0 for e in todo
    }
    need = sum(e.size - min(part_sizes[e.name], e.size) for e in todo)
    free = shutil.disk_usage(root).free
    if need > free:
        raise InsufficientSpace(
            root, f"needs {need} more bytes for {', '.join(e.name for e in todo)}, only {free} free"
        )
    for entry in todo:
        _provision_file(entry, source, root, part_sizes[entry.name], report, progress)
    if progress:
        progress.finish()
    return report


def _part(root: Path, entry: FileEntry) -> Path:
    return root / f".{entry.name}.part"


def _provision_file(
    entry: FileEntry,
    source: str,
    root: Path,
    have: int,
    report: ProvisionReport,
    progress: Progress | None,
) -> None:
    part = _part(root, entry)
    if have > entry.size:
        part.unlink()
        have = 0
    stream, served = _open_source(source, entry.name, have)
    with stream:
        report.resumed_bytes += served
        report.bytes_copied += write_stream(
            part, _blocks(stream), append=served > 0, progress=progress
        )
    bad = _chunks_match(part, entry)
    if bad is not None:
        part.unlink()
        raise HashMismatch(
            root / entry.name,
            f"chunk {bad} does not match the manifest after copying from {source}; discarded",
        )
    os.replace(part, root / entry.name)
    _fsync_dir(root)
    report.fetched.append(entry.name)
