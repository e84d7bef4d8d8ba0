"""Fixtures: the real repository, and throw-away copies of its planning files to run tools on."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from dgr_prd.paths import RepoPaths

REPO = Path(__file__).resolve().parents[3]
PLANNING_FILES = ["prd.json", "PRD.md", "RALPH-CONTEXT.md", "noxfile.py", "docs/perf.md"]
PLANNING_DIRS = ["schemas", "stories", "evidence"]


@pytest.fixture
def repo() -> RepoPaths:
    return RepoPaths(REPO)


@pytest.fixture
def prd_data(repo: RepoPaths) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(repo.prd.read_text(encoding="utf-8"))
    return data


def _git(root: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.email=t@t", "-c", "user.name=t", *args],
        cwd=root,
        check=True,
        capture_output=True,
    )


@pytest.fixture
def repo_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RepoPaths:
    """A git repository holding a copy of the planning files; DGR_REPO_ROOT points at it."""
    root = tmp_path / "repo"
    root.mkdir()
    for name in PLANNING_FILES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, root / name)
    for name in PLANNING_DIRS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, root / name)
    (root / "evidence").mkdir(exist_ok=True)
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "copy")
    monkeypatch.setenv("DGR_REPO_ROOT", str(root))
    return RepoPaths(root)


def commit_all(root: Path, message: str) -> None:
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", message, "--allow-empty")


EditStory = Callable[[str, Callable[[dict[str, Any]], object]], None]


@pytest.fixture
def edit_story(repo_copy: RepoPaths) -> EditStory:
    """Apply `change` to one story (as a dict) of the copy's prd.json and rewrite the file."""

    def edit(story_id: str, change: Callable[[dict[str, Any]], object]) -> None:
        data = json.loads(repo_copy.prd.read_text(encoding="utf-8"))
        change(next(s for s in data["stories"] if s["id"] == story_id))
        repo_copy.prd.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        commit_all(repo_copy.root, f"edit {story_id}")  # stories are run from committed trees

    return edit
