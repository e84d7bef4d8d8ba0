"""The numbered llama.cpp patch stack: parse, apply, check, reverse, refresh.

Patches live in native/llama.cpp/patches/NNNN-slug.patch. Each starts with a header:

    DGR-Patch: NNNN-slug
    Story: DGR-0NN
    What: one line on what it changes
    Why: one line on why llama.cpp needs it

then a line `---` and a unified diff (paths a/... b/... relative to the llama.cpp root).

The patched tree is a git repository whose first commit is the pristine tree and whose later
commits are the patches, one each, so that `refresh` can regenerate the patch files from edits
made there (commit per patch, or leave edits uncommitted to fold them into the top patch).
"""

from __future__ import annotations

import filecmp
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dgr_prd.native_pin import patch_stack_hash

from dgr_llamacpp.tree import tree_hash

NAME = re.compile(r"^(\d{4})-([a-z0-9][a-z0-9-]*)\.patch$")
HEADER_FIELDS = ("DGR-Patch", "Story", "What", "Why")
STORY = re.compile(r"^DGR-0[1-9][0-9]$")
STAMP = ".dgr-patched"
GIT_ID = [
    "-c",
    "user.name=dgr-patches",
    "-c",
    "user.email=patches@dgr.invalid",
    "-c",
    "commit.gpgsign=false",
    "-c",
    "core.autocrlf=false",
]


# The sdist's tree carries a submodule `.git` pointer file; it is not source and not hashed.
NOT_SOURCE = shutil.ignore_patterns(".git", ".dgr-stamp.json")


class PatchError(Exception):
    """A patch is malformed, out of order, or does not apply cleanly."""


@dataclass(frozen=True)
class Patch:
    path: Path
    number: int
    slug: str
    story: str
    what: str
    why: str
    diff: str

    @property
    def name(self) -> str:
        return f"{self.number:04d}-{self.slug}"

    def header(self) -> str:
        return (
            f"DGR-Patch: {self.name}\nStory: {self.story}\nWhat: {self.what}\n"
            f"Why: {self.why}\n---\n"
        )


def parse_patch(path: Path) -> Patch:
    match = NAME.match(path.name)
    if not match:
        raise PatchError(f"{path.name}: patch files are named NNNN-slug.patch")
    text = path.read_text(encoding="utf-8")
    head, sep, diff = text.partition("\n---\n")
    if not sep:
        raise PatchError(f"{path.name}: no header (fields {', '.join(HEADER_FIELDS)}, then ---)")
    fields = {}
    for line in head.splitlines():
        key, colon, value = line.partition(":")
        if colon and key.strip() in HEADER_FIELDS:
            fields[key.strip()] = value.strip()
    missing = [f for f in HEADER_FIELDS if not fields.get(f)]
    if missing:
        raise PatchError(f"{path.name}: header lacks {', '.join(missing)}")
    if fields["DGR-Patch"] != path.name.removesuffix(".patch"):
        raise PatchError(f"{path.name}: header names {fields['DGR-Patch']!r}")
    if not STORY.match(fields["Story"]):
        raise PatchError(f"{path.name}: Story must be a DGR-0NN id, not {fields['Story']!r}")
    if "diff --git " not in diff and "\n+++ " not in "\n" + diff:
        raise PatchError(f"{path.name}: no unified diff after the header")
    return Patch(
        path,
        int(match.group(1)),
        match.group(2),
        fields["Story"],
        fields["What"],
        fields["Why"],
        diff,
    )


def load_stack(patches_dir: Path) -> list[Patch]:
    files = sorted(p for p in patches_dir.glob("*") if p.is_file() and p.name != "README.md")
    stack = [parse_patch(p) for p in files]
    for expected, patch in enumerate(stack, start=1):
        if patch.number != expected:
            raise PatchError(
                f"{patch.path.name}: expected number {expected:04d}; the stack is "
                f"numbered 0001, 0002, ... without gaps"
            )
    return stack


def _git(tree: Path, *args: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        ["git", *GIT_ID, *args], cwd=tree, input=stdin, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise PatchError(f"git {' '.join(args[:2])} failed in {tree}: {done.stderr.strip()}")
    return done.stdout


def apply_patch(tree: Path, patch: Patch, reverse: bool = False) -> None:
    args = ["apply", "--whitespace=nowarn", *(["-R"] if reverse else [])]
    check = subprocess.run(
        ["git", *args, "--check", "-"],
        cwd=tree,
        input=patch.diff,
        capture_output=True,
        text=True,
        check=False,
    )
    if check.returncode != 0:
        verb = "reverse" if reverse else "apply"
        raise PatchError(f"{patch.path.name} does not {verb} cleanly: {check.stderr.strip()}")
    _git(tree, *args, "-", stdin=patch.diff)


def check_stack(pristine: Path, stack: list[Patch], expected_tree: str) -> list[str]:
    """Apply every patch in order to a fresh copy, then reverse them all; return a report.

    Raises PatchError naming the first patch that does not apply or reverse cleanly, or when the
    reversed tree is not byte-identical to the pin.
    """
    report = []
    with tempfile.TemporaryDirectory(prefix="dgr-patch-check-") as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(pristine, tree, symlinks=True, ignore=NOT_SOURCE)
        for patch in stack:
            apply_patch(tree, patch)
            report.append(f"applied  {patch.path.name} ({patch.story}): {patch.what}")
        for patch in reversed(stack):
            apply_patch(tree, patch, reverse=True)
            report.append(f"reversed {patch.path.name}")
        actual = tree_hash(tree)
        if actual != expected_tree:
            raise PatchError(f"reversing the stack left tree {actual}, not the pin {expected_tree}")
        report.append(f"reversed tree equals the pin ({expected_tree[:16]}...)")
    return report


def _sync(src: Path, dst: Path) -> int:
    """Make dst's files equal src's, touching only files whose content differs (keeps mtimes,
    so a build directory over dst recompiles only what a patch changed). Returns files written."""
    written = 0
    src_files = set()
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        rel_dir = Path(dirpath).relative_to(src)
        (dst / rel_dir).mkdir(parents=True, exist_ok=True)
        for name in filenames:
            rel = rel_dir / name
            src_files.add(rel)
            target = dst / rel
            if not target.is_file() or not filecmp.cmp(Path(dirpath) / name, target, shallow=False):
                shutil.copy2(Path(dirpath) / name, target)
                written += 1
    for dirpath, dirnames, filenames in os.walk(dst):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        for name in filenames:
            rel = Path(dirpath).relative_to(dst) / name
            if rel not in src_files and name != STAMP:
                (dst / rel).unlink()
                written += 1
    return written


def apply_stack(pristine: Path, patched: Path, patches_dir: Path) -> tuple[Path, bool]:
    """Bring `patched` to pristine + the whole stack, one git commit per patch.

    Returns (tree, changed). When the stamp already names this stack, nothing is touched.
    """
    stack = load_stack(patches_dir)
    wanted = patch_stack_hash(patches_dir) or "empty"
    stamp = patched / STAMP
    if stamp.is_file() and stamp.read_text().strip() == wanted:
        return patched, False
    with tempfile.TemporaryDirectory(dir=patched.parent, prefix=".patching-") as tmp:
        staging = Path(tmp) / "tree"
        shutil.copytree(pristine, staging, symlinks=True, ignore=NOT_SOURCE)
        _git(staging, "init", "-q")
        _git(staging, "add", "-A")
        _git(staging, "commit", "-q", "--no-verify", "-m", "pristine llama.cpp (pinned)")
        for patch in stack:
            apply_patch(staging, patch)
            _git(staging, "add", "-A")
            subject, _, fields = patch.header().removesuffix("---\n").partition("\n")
            _git(staging, "commit", "-q", "--no-verify", "-m", subject, "-m", fields)
        patched.mkdir(parents=True, exist_ok=True)
        _sync(staging, patched)
        if (patched / ".git").exists():
            shutil.rmtree(patched / ".git")
        shutil.move(str(staging / ".git"), str(patched / ".git"))
    stamp.write_text(wanted + "\n", encoding="utf-8")
    (patched / ".git" / "info").mkdir(exist_ok=True)
    (patched / ".git" / "info" / "exclude").write_text(f"{STAMP}\n", encoding="utf-8")
    return patched, True


def refresh(patched: Path, patches_dir: Path) -> list[Path]:
    """Regenerate the patch files from the patched tree's commits; uncommitted edits are
    folded into the top patch first. Headers come from the commit messages."""
    if _git(patched, "status", "--porcelain").strip():
        _git(patched, "add", "-A")
        _git(patched, "commit", "-q", "--amend", "--no-edit", "--no-verify")
    commits = _git(patched, "rev-list", "--reverse", "HEAD").split()[1:]
    written = []
    for old in patches_dir.glob("*.patch"):
        old.unlink()
    for commit in commits:
        message = _git(patched, "log", "-1", "--format=%B", commit)
        fields = dict(
            (k.strip(), v.strip())
            for k, _, v in (line.partition(":") for line in message.splitlines() if ":" in line)
        )
        name = fields.get("DGR-Patch")
        if not name:
            raise PatchError(f"commit {commit[:12]} has no DGR-Patch header in its message")
        diff = _git(
            patched, "diff", "--no-color", "--no-ext-diff", "--full-index", f"{commit}~1", commit
        )
        header = "".join(f"{k}: {fields.get(k, '')}\n" for k in HEADER_FIELDS) + "---\n"
        path = patches_dir / f"{name}.patch"
        path.write_text(header + diff, encoding="utf-8")
        parse_patch(path)
        written.append(path)
    (patched / STAMP).write_text((patch_stack_hash(patches_dir) or "empty") + "\n")
    return written
