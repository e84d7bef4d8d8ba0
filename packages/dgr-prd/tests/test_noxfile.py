"""nox lists one session per story and runs them through the runner."""

from __future__ import annotations

import subprocess
from typing import Any

from dgr_prd.model import load_prd
from dgr_prd.paths import RepoPaths


def nox(paths: RepoPaths, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["nox", "-f", str(paths.root / "noxfile.py"), *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=paths.root,
    )


def test_nox_lists_every_story_with_its_title(repo: RepoPaths) -> None:
    listing = nox(repo, "-l")
    assert listing.returncode == 0, listing.stderr
    prd = load_prd(repo.prd)
    for story in prd.stories:
        assert f"story-{story.id} -> {story.title}" in listing.stdout
    # and no story session for what is not a story
    lines = listing.stdout.splitlines()
    listed = {line.split()[1] for line in lines if line.startswith("- story-DGR-")}
    assert listed == {f"story-{s.id}" for s in prd.stories}


def test_unimplemented_story_fails_clearly_through_nox(
    repo_copy: RepoPaths, edit_story: Any
) -> None:
    for story_id in ("DGR-017", "DGR-018", "DGR-019"):
        edit_story(
            story_id,
            lambda s: s.update(
                evidence=[{"name": "ok", "run": "true", "lane": "cpu", "implemented": True}]
            ),
        )
        assert nox(repo_copy, "-s", f"story-{story_id}").returncode == 0
    planned = {
        "name": "native-fetch",
        "run": "nox -s native-fetch",
        "lane": "cpu",
        "implemented": False,
    }
    edit_story("DGR-027", lambda s: s.update(evidence=[planned]))
    result = nox(repo_copy, "-s", "story-DGR-027")
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "evidence not implemented" in output
    assert "native-fetch" in output


def test_story_with_undone_dependency_is_refused(repo_copy: RepoPaths, edit_story: Any) -> None:
    edit_story("DGR-022", lambda s: s.update(status="todo", passes=False))
    result = nox(repo_copy, "-s", "story-DGR-023")
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "REFUSED" in output and "DGR-022 (todo)" in output
