"""PRD.md, stories/ and RALPH-CONTEXT.md's status are current views of prd.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dgr_prd import legacy
from dgr_prd.model import load_prd
from dgr_prd.paths import RepoPaths
from dgr_prd.projections import (
    STATUS_BEGIN,
    refresh_ralph,
    render_prd_md,
    render_story,
    stale_projections,
    write_projections,
)


def test_committed_projections_are_current(repo: RepoPaths) -> None:
    assert stale_projections(repo, load_prd(repo.prd)) == [], "run `nox -s prd`"


def test_every_story_has_a_spec_and_a_prd_section(repo: RepoPaths) -> None:
    prd = load_prd(repo.prd)
    text = render_prd_md(prd)
    for story in prd.stories:
        assert f"### {story.id}: {story.title}" in text
        spec = (repo.stories / f"{story.id}.md").read_text()
        assert spec == render_story(story)
        assert all(a in spec for a in story.acceptance)
        assert f"nox -s story-{story.id}" in spec
    for gate in prd.gates:
        for threshold in gate.thresholds:
            assert f"`{threshold.metric}`" in text


def test_an_edit_to_prd_json_makes_projections_stale(repo_copy: RepoPaths, edit_story: Any) -> None:
    edit_story("DGR-045", lambda s: s["acceptance"].append("A new checkable sentence."))
    prd = load_prd(repo_copy.prd)
    assert stale_projections(repo_copy, prd) == ["PRD.md", "stories/DGR-045.md"]
    assert "stories/DGR-045.md" in str(legacy.problems(repo_copy))
    write_projections(repo_copy, prd)
    assert stale_projections(repo_copy, prd) == []
    assert legacy.problems(repo_copy) == []


def test_stray_story_file_is_stale(repo_copy: RepoPaths) -> None:
    (repo_copy.stories / "DGR-099.md").write_text("# stray\n")
    assert stale_projections(repo_copy, load_prd(repo_copy.prd)) == [
        "stories/DGR-099.md (not a story)"
    ]


def test_ralph_needs_its_markers() -> None:
    with pytest.raises(ValueError, match="markers"):
        refresh_ralph("# no markers here\n", STATUS_BEGIN)


def test_legacy_specs_are_found(repo_copy: RepoPaths) -> None:
    (repo_copy.root / "issues").mkdir()
    (repo_copy.stories / "03-shard-worker.md").write_text("legacy\n")
    problems = legacy.problems(repo_copy)
    assert any("issues competes with prd.json" in p for p in problems)
    assert any("legacy story spec stories/03-shard-worker.md" in p for p in problems)


def test_writing_the_backlog_back_changes_nothing_it_did_not_set(
    repo: RepoPaths, tmp_path: Path
) -> None:
    # the runner loads prd.json, sets a story's status and dumps it: an optional field the file
    # leaves out (a threshold's compute_threads) must not come back as null
    from dgr_prd.model import dump_prd

    out = tmp_path / "prd.json"
    dump_prd(load_prd(repo.prd), out)
    assert out.read_text(encoding="utf-8") == repo.prd.read_text(encoding="utf-8")
