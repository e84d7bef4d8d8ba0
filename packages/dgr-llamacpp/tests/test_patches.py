"""Patch-stack tooling on a small tree of its own: parse, check, apply, reverse, refresh."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from dgr_llamacpp import patches
from dgr_llamacpp.tree import tree_hash

HEADER = "DGR-Patch: {name}\nStory: DGR-029\nWhat: {what}\nWhy: tests need a patch\n---\n"


def make_tree(root: Path) -> Path:
    (root / "src").mkdir(parents=True)
    (root / "src" / "model.cpp").write_text("int layers() {\n    return 30;\n}\n")
    (root / "README.md").write_text("pristine\n")
    return root


def diff_of(tree: Path, edit: dict[str, str]) -> str:
    """A unified diff (a/ b/ prefixes) of `edit` applied to `tree`, made with git."""
    work = tree.parent / f".diff-{abs(hash(str(edit)))}"
    shutil.copytree(tree, work)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], cwd=work, check=True)
    subprocess.run([*git, "add", "-A"], cwd=work, check=True)
    subprocess.run([*git, "commit", "-qm", "base"], cwd=work, check=True)
    for rel, text in edit.items():
        (work / rel).write_text(text)
    out = subprocess.run([*git, "diff"], cwd=work, check=True, capture_output=True, text=True)
    shutil.rmtree(work)
    return out.stdout


def write_patch(patch_dir: Path, name: str, what: str, diff: str) -> Path:
    patch_dir.mkdir(exist_ok=True)
    path = patch_dir / f"{name}.patch"
    path.write_text(HEADER.format(name=name, what=what) + diff)
    return path


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path]:
    pristine = make_tree(tmp_path / "pristine")
    patch_dir = tmp_path / "patches"
    first = {"src/model.cpp": "int layers() {\n    return owned_last - owned_first;\n}\n"}
    write_patch(patch_dir, "0001-range", "own a layer range", diff_of(pristine, first))
    both = {**first, "README.md": "patched\n"}
    second = diff_of(pristine, both).split("diff --git a/src")[0]  # only the README hunk
    write_patch(patch_dir, "0002-readme", "say so", second)
    return pristine, patch_dir


def test_check_applies_in_order_and_reverses_to_the_pin(setup: tuple[Path, Path]) -> None:
    pristine, patch_dir = setup
    stack = patches.load_stack(patch_dir)
    assert [p.name for p in stack] == ["0001-range", "0002-readme"]
    report = patches.check_stack(pristine, stack, tree_hash(pristine))
    assert report[0].startswith("applied  0001-range.patch (DGR-029)")
    assert report[-1].startswith("reversed tree equals the pin")


def test_a_patch_that_does_not_apply_is_named(setup: tuple[Path, Path]) -> None:
    pristine, patch_dir = setup
    (pristine / "src" / "model.cpp").write_text("int layers() {\n    return 42;\n}\n")
    with pytest.raises(patches.PatchError, match=r"0001-range\.patch does not apply cleanly"):
        patches.check_stack(pristine, patches.load_stack(patch_dir), tree_hash(pristine))


def test_header_and_numbering_are_enforced(setup: tuple[Path, Path]) -> None:
    _, patch_dir = setup
    body = (patch_dir / "0002-readme.patch").read_text().split("---\n", 1)[1]
    (patch_dir / "0002-readme.patch").write_text(
        "DGR-Patch: 0002-readme\nStory: DGR-029\n---\n" + body
    )
    with pytest.raises(patches.PatchError, match="header lacks What, Why"):
        patches.load_stack(patch_dir)
    (patch_dir / "0002-readme.patch").unlink()
    write_patch(patch_dir, "0003-gap", "skips 0002", body)
    with pytest.raises(patches.PatchError, match="expected number 0002"):
        patches.load_stack(patch_dir)
    (patch_dir / "0003-gap.patch").write_text(
        HEADER.format(name="0003-gap", what="x").replace("DGR-029", "story 29") + body
    )
    with pytest.raises(patches.PatchError, match="Story must be a DGR-0NN id"):
        patches.parse_patch(patch_dir / "0003-gap.patch")
    (patch_dir / "no-number.patch").write_text("x")
    with pytest.raises(patches.PatchError, match=r"named NNNN-slug\.patch"):
        patches.parse_patch(patch_dir / "no-number.patch")


def test_apply_is_idempotent_and_keeps_untouched_mtimes(
    setup: tuple[Path, Path], tmp_path: Path
) -> None:
    pristine, patch_dir = setup
    patched = tmp_path / "patched"
    tree, changed = patches.apply_stack(pristine, patched, patch_dir)
    assert changed and "owned_last" in (tree / "src" / "model.cpp").read_text()
    assert (tree / "README.md").read_text() == "patched\n"
    log = subprocess.run(
        ["git", "log", "--format=%s"], cwd=tree, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert log == ["DGR-Patch: 0002-readme", "DGR-Patch: 0001-range", "pristine llama.cpp (pinned)"]
    os.utime(tree / "src" / "model.cpp", (1_000_000, 1_000_000))
    assert patches.apply_stack(pristine, patched, patch_dir) == (tree, False)
    (patch_dir / "0002-readme.patch").unlink()
    _, changed = patches.apply_stack(pristine, patched, patch_dir)
    assert changed and (tree / "README.md").read_text() == "pristine\n"
    assert (tree / "src" / "model.cpp").stat().st_mtime == 1_000_000  # not rewritten


def test_refresh_folds_edits_into_the_top_patch(setup: tuple[Path, Path], tmp_path: Path) -> None:
    pristine, patch_dir = setup
    patched, _ = patches.apply_stack(pristine, tmp_path / "patched", patch_dir)
    (patched / "README.md").write_text("patched and refreshed\n")
    written = patches.refresh(patched, patch_dir)
    assert [p.name for p in written] == ["0001-range.patch", "0002-readme.patch"]
    top = patches.parse_patch(patch_dir / "0002-readme.patch")
    assert top.what == "say so" and "+patched and refreshed" in top.diff
    patches.check_stack(pristine, patches.load_stack(patch_dir), tree_hash(pristine))
    assert patches.apply_stack(pristine, patched, patch_dir)[1] is False
