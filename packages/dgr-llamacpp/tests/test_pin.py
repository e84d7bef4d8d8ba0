"""The llama.cpp pin: manifest, archive and tree verification on the real pinned source."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import pytest
from dgr_artifacts.downloads import cache_dir
from dgr_llamacpp.fetch import (
    HashMismatch,
    PinError,
    archs_in_tree,
    download_sdist,
    fetch,
    verify_archive,
)
from dgr_llamacpp.manifest import LlamaPin, load_pin
from dgr_llamacpp.tree import tree_hash

REPO = Path(__file__).resolve().parents[3]
PIN = load_pin(REPO / "native" / "llama.cpp" / "manifest.json")


@pytest.fixture(scope="session")
def archive() -> Path:
    return download_sdist(PIN.sdist(), cache_dir() / "archives", io.StringIO())


@pytest.fixture(scope="session")
def pinned_tree(archive: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fetch(PIN, tmp_path_factory.mktemp("ws"), io.StringIO())


def test_manifest_names_the_exact_upstream_commit() -> None:
    assert PIN.commit == "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
    assert PIN.sdist().package == "llama-cpp-python" and PIN.sdist().version == "0.3.36"
    assert PIN.sdist().subdir == "vendor/llama.cpp"
    assert {"deepseek4", "llama", "gemma3"} <= set(PIN.required_archs)


def test_real_archive_and_tree_verify(archive: Path, pinned_tree: Path) -> None:
    verify_archive(archive, PIN.sdist())
    assert tree_hash(pinned_tree) == PIN.tree_sha256
    assert (pinned_tree / "src" / "models" / "deepseek4.cpp").is_file()
    assert {"deepseek4", "llama", "gemma3"} <= archs_in_tree(pinned_tree)


def test_second_fetch_reuses_the_verified_tree(pinned_tree: Path) -> None:
    log = io.StringIO()
    assert fetch(PIN, pinned_tree.parent, log) == pinned_tree
    assert "already present and verified" in log.getvalue()


def test_tampered_archive_is_refused(archive: Path, tmp_path: Path) -> None:
    bad = tmp_path / archive.name
    shutil.copyfile(archive, bad)
    with bad.open("r+b") as fh:
        fh.seek(1_000_000)
        byte = fh.read(1)
        fh.seek(1_000_000)
        fh.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(HashMismatch, match="archive sha256 hash mismatch") as info:
        verify_archive(bad, PIN.sdist())
    assert info.value.expected == PIN.sdist().sha256
    with bad.open("ab") as fh:
        fh.write(b"x")
    with pytest.raises(HashMismatch, match="archive size"):
        verify_archive(bad, PIN.sdist())


def test_tampered_tree_is_refused(pinned_tree: Path, tmp_path: Path) -> None:
    copy = tmp_path / pinned_tree.name
    shutil.copytree(pinned_tree, copy, symlinks=True)
    (copy / "src" / "llama.cpp").write_text("// tampered\n")
    with pytest.raises(HashMismatch, match="tree content hash mismatch"):
        fetch(PIN, tmp_path, io.StringIO())


def test_wrong_tree_hash_in_manifest_is_refused(archive: Path, tmp_path: Path) -> None:
    wrong = PIN.model_copy(update={"tree_sha256": "0" * 64})
    with pytest.raises(HashMismatch, match="tree content"):
        fetch(wrong, tmp_path, io.StringIO())
    assert not any(p for p in tmp_path.iterdir() if not p.name.startswith("."))


def test_missing_required_arch_is_refused(archive: Path, tmp_path: Path) -> None:
    needs_more = LlamaPin.model_validate({**PIN.model_dump(), "required_archs": ["no-such-arch"]})
    with pytest.raises(PinError, match="lacks required architectures: no-such-arch"):
        fetch(needs_more, tmp_path, io.StringIO())


def test_tree_hash_sees_content_mode_and_names(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f.txt").write_text("a")
    first = tree_hash(tmp_path)
    assert tree_hash(tmp_path) == first
    (tmp_path / "d" / "f.txt").write_text("b")
    second = tree_hash(tmp_path)
    assert second != first
    os.chmod(tmp_path / "d" / "f.txt", 0o755)
    assert tree_hash(tmp_path) != second
    (tmp_path / "d" / "f.txt").rename(tmp_path / "d" / "g.txt")
    assert tree_hash(tmp_path) not in (first, second)


def test_the_real_patch_stack_applies_cleanly_to_the_pin(pinned_tree: Path) -> None:
    from dgr_llamacpp.patches import check_stack, load_stack

    stack = load_stack(REPO / "native" / "llama.cpp" / "patches")
    report = check_stack(pinned_tree, stack, PIN.tree_sha256)
    assert report[-1].startswith("reversed tree equals the pin")
