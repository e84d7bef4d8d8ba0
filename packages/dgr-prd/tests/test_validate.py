"""Backlog rules: each error names the story and the field."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
from dgr_prd.paths import RepoPaths
from dgr_prd.validate import EXPECTED_IDS, PrdInvalid, PrdIssue, validate_file


def _issues(paths: RepoPaths) -> list[PrdIssue]:
    with pytest.raises(PrdInvalid) as info:
        validate_file(paths.prd, paths.schemas / "prd.schema.json", paths.evidence)
    return info.value.issues


def test_the_real_backlog_is_valid(repo: RepoPaths) -> None:
    prd = validate_file(repo.prd, repo.schemas / "prd.schema.json", repo.evidence)
    assert [s.id for s in prd.stories] == EXPECTED_IDS


def test_unknown_dependency(repo_copy: RepoPaths, edit_story: Any) -> None:
    edit_story("DGR-030", lambda s: s["depends_on"].append("DGR-099"))
    assert PrdIssue("DGR-030", "depends_on", "unknown story DGR-099") in _issues(repo_copy)


def test_unknown_story_id(repo_copy: RepoPaths, edit_story: Any) -> None:
    edit_story("DGR-071", lambda s: s.update(id="DGR-072"))
    messages = {(i.story, i.field, i.message) for i in _issues(repo_copy)}
    assert ("DGR-072", "id", "unknown story id (backlog is DGR-017..DGR-071)") in messages
    assert ("DGR-071", "id", "story missing from prd.json") in messages


def test_duplicate_story_id(repo_copy: RepoPaths, edit_story: Any) -> None:
    edit_story("DGR-041", lambda s: s.update(id="DGR-040"))
    assert PrdIssue("DGR-040", "id", "duplicate story id") in _issues(repo_copy)


def test_dependency_cycle(repo_copy: RepoPaths, edit_story: Any) -> None:
    edit_story("DGR-027", lambda s: s["depends_on"].append("DGR-029"))
    issues = [i for i in _issues(repo_copy) if "cycle" in i.message]
    assert issues and issues[0].field == "depends_on"
    assert "DGR-027" in issues[0].message and "DGR-029" in issues[0].message


def test_alpha_story_on_later_beta_story(repo_copy: RepoPaths, edit_story: Any) -> None:
    edit_story("DGR-046", lambda s: s["depends_on"].append("DGR-068"))
    issue = next(i for i in _issues(repo_copy) if "beta" in i.message)
    assert (issue.story, issue.field) == ("DGR-046", "depends_on")
    assert "DGR-068" in issue.message and "M9" in issue.message


def test_beta_dependency_in_same_milestone_is_allowed(
    repo_copy: RepoPaths, edit_story: Any
) -> None:
    edit_story("DGR-070", lambda s: s["depends_on"].append("DGR-069"))
    validate_file(repo_copy.prd, repo_copy.schemas / "prd.schema.json", repo_copy.evidence)


def test_passes_without_evidence(repo_copy: RepoPaths, edit_story: Any) -> None:
    shutil.rmtree(repo_copy.evidence / "DGR-030", ignore_errors=True)
    edit_story("DGR-030", lambda s: s.update(status="done", passes=True))
    assert PrdIssue("DGR-030", "passes", "passes is true but no evidence record exists") in (
        _issues(repo_copy)
    )


def test_status_and_passes_must_agree(repo_copy: RepoPaths, edit_story: Any) -> None:
    edit_story("DGR-031", lambda s: s.update(status="done", passes=False))
    issue = next(i for i in _issues(repo_copy) if i.story == "DGR-031")
    assert issue.field == "passes" and "disagrees" in issue.message


def test_schema_errors_name_story_and_field(repo_copy: RepoPaths, edit_story: Any) -> None:
    edit_story("DGR-033", lambda s: s.update(gate="gamma"))
    issue = _issues(repo_copy)[0]
    assert (issue.story, issue.field) == ("DGR-033", "gate")
    assert "gamma" in issue.message


def test_malformed_json_is_a_typed_error(repo_copy: RepoPaths) -> None:
    repo_copy.prd.write_text("{ not json")
    assert _issues(repo_copy)[0].field == "(file)"
