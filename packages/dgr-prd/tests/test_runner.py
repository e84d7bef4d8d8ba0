"""The story runner, run for real on a copy of the repository's planning files."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from dgr_prd import runner
from dgr_prd.evidence import LATEST, Result, latest_record
from dgr_prd.model import Status, load_prd
from dgr_prd.paths import RepoPaths
from dgr_prd.projections import stale_projections
from dgr_prd.validate import validate_file

METRICS_CMD = (
    'echo hello from evidence; python -c "import json, os; '
    "open(os.environ['DGR_METRICS'], 'w').write(json.dumps({'tok_s': 12.5, 'parity': 0}))\""
)


def cmd(name: str, run: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "run": run, "lane": "cpu", "required": True, "implemented": True, **extra}


def set_evidence(edit_story: Any, story_id: str, *commands: dict[str, Any]) -> None:
    edit_story(story_id, lambda s: s.update(evidence=list(commands)))


def run(paths: RepoPaths, story_id: str, **kwargs: Any) -> tuple[runner.RunOutcome, str]:
    """Run a story, then commit what it wrote (as a developer commits evidence before the next
    run: a story is marked done only from a committed tree)."""
    stream = io.StringIO()
    outcome = runner.run_story(paths, story_id, stream=stream, **kwargs)
    for args in (["add", "-A"], ["commit", "-qm", f"evidence {story_id}", "--allow-empty"]):
        subprocess.run(["git", *args], cwd=paths.root, check=True, capture_output=True)
    return outcome, stream.getvalue()


def status_of(paths: RepoPaths, story_id: str) -> tuple[Status, bool]:
    story = load_prd(paths.prd).story(story_id)
    return story.status, story.passes


def test_pass_writes_evidence_and_marks_done(repo_copy: RepoPaths, edit_story: Any) -> None:
    set_evidence(edit_story, "DGR-017", cmd("hello", METRICS_CMD))
    for story_id in ("DGR-017", "DGR-018"):
        edit_story(story_id, lambda s: s.update(status="todo", passes=False))
    outcome, out = run(repo_copy, "DGR-017")

    assert outcome.exit_code == runner.EXIT_PASS
    assert "hello from evidence" in out
    record = outcome.record
    assert record.result is Result.PASS
    assert record.metrics == {"hello": {"tok_s": 12.5, "parity": 0}}
    assert record.git.commit and len(record.git.commit) == 40
    assert record.hardware["cpu"]["cores"] >= 1
    assert (repo_copy.evidence / "DGR-017" / LATEST).read_text().strip() == record.run_id
    schema = json.loads((repo_copy.schemas / "evidence.schema.json").read_text())
    jsonschema.validate(json.loads((outcome.run_dir / "evidence.json").read_text()), schema)
    assert (outcome.run_dir / "hello.log").read_text().startswith("hello from evidence")

    handoff = (outcome.run_dir / "handoff.md").read_text()
    for heading in ("## What ran", "## What it showed", "## What is left", "## Reproduce"):
        assert heading in handoff
    assert "`hello.tok_s` | 12.5" in handoff and "nox -s story-DGR-017" in handoff
    assert "Now unblocked: DGR-018" in handoff

    assert status_of(repo_copy, "DGR-017") == (Status.DONE, True)
    prd = validate_file(repo_copy.prd, repo_copy.schemas / "prd.schema.json", repo_copy.evidence)
    assert stale_projections(repo_copy, prd) == []
    assert f"| DGR-017 | {prd.story('DGR-017').title} | done | pass |" in (
        repo_copy.ralph.read_text()
    )


def test_undone_dependency_refuses_without_writing(repo_copy: RepoPaths, edit_story: Any) -> None:
    edit_story("DGR-018", lambda s: s.update(status="todo", passes=False))
    before = sorted(p.name for p in repo_copy.evidence.rglob("*"))
    prd_before = repo_copy.prd.read_text()
    with pytest.raises(runner.DependenciesNotDone, match=r"DGR-018 \(todo\)"):
        run(repo_copy, "DGR-019")
    assert sorted(p.name for p in repo_copy.evidence.rglob("*")) == before
    assert repo_copy.prd.read_text() == prd_before


def test_override_is_recorded_and_never_marks_done(repo_copy: RepoPaths, edit_story: Any) -> None:
    for story_id in ("DGR-017", "DGR-018", "DGR-019"):  # a clean chain: DGR-019 done
        set_evidence(edit_story, story_id, cmd("ok", "true"))
        run(repo_copy, story_id)
    assert status_of(repo_copy, "DGR-019") == (Status.DONE, True)
    edit_story("DGR-018", lambda s: s.update(status="todo", passes=False))
    outcome, out = run(repo_copy, "DGR-019", override_deps=True)
    assert "dependencies overridden: DGR-018 (todo)" in out
    assert outcome.record.result is Result.PASS
    assert outcome.record.dependency_override == ["DGR-018"]
    assert "not marked done" in outcome.record.reason
    assert status_of(repo_copy, "DGR-019") == (Status.IN_PROGRESS, False)


def test_a_dirty_tree_never_marks_done(repo_copy: RepoPaths, edit_story: Any) -> None:
    set_evidence(edit_story, "DGR-017", cmd("ok", "true"))
    edit_story("DGR-017", lambda s: s.update(status="todo", passes=False))
    (repo_copy.root / "notes.txt").write_text("uncommitted\n")
    outcome, out = run(repo_copy, "DGR-017")
    assert outcome.record.result is Result.PASS and outcome.record.git.dirty
    assert "uncommitted changes" in outcome.record.reason and "not marked done" in out
    assert status_of(repo_copy, "DGR-017") == (Status.TODO, False)
    outcome, _ = run(repo_copy, "DGR-017")  # the same run from the committed tree
    assert not outcome.record.git.dirty
    assert status_of(repo_copy, "DGR-017") == (Status.DONE, True)


def test_missing_lane_is_skipped_not_passed(repo_copy: RepoPaths, edit_story: Any) -> None:
    set_evidence(
        edit_story,
        "DGR-017",
        cmd("cpu-part", "true"),
        cmd("metal-part", "touch ran-on-metal", lane="metal"),
    )
    status = status_of(repo_copy, "DGR-017")
    outcome, _ = run(repo_copy, "DGR-017")
    assert outcome.exit_code == runner.EXIT_SKIPPED
    metal = outcome.record.commands[1]
    assert metal.result is Result.SKIPPED and metal.exit_code is None
    assert "lane metal unavailable" in metal.reason
    assert outcome.record.result is Result.SKIPPED
    assert not (repo_copy.root / "ran-on-metal").exists()
    assert status_of(repo_copy, "DGR-017") == status


def test_planned_evidence_fails_honestly(repo_copy: RepoPaths, edit_story: Any) -> None:
    set_evidence(edit_story, "DGR-017", cmd("planned", "touch should-not-run", implemented=False))
    outcome, out = run(repo_copy, "DGR-017")
    assert outcome.exit_code == runner.EXIT_FAIL
    assert "evidence not implemented" in out
    assert "evidence not implemented" in outcome.record.reason
    assert not (repo_copy.root / "should-not-run").exists()
    assert status_of(repo_copy, "DGR-017")[1] is False


def test_failure_regresses_a_done_story(repo_copy: RepoPaths, edit_story: Any) -> None:
    set_evidence(edit_story, "DGR-017", cmd("check", "true"))
    run(repo_copy, "DGR-017")
    assert status_of(repo_copy, "DGR-017") == (Status.DONE, True)
    set_evidence(edit_story, "DGR-017", cmd("check", "echo broken; exit 3"))
    outcome, _ = run(repo_copy, "DGR-017")
    assert outcome.record.commands[0].exit_code == 3
    assert outcome.record.reason == "check: exit code 3"
    assert status_of(repo_copy, "DGR-017") == (Status.IN_PROGRESS, False)
    validate_file(repo_copy.prd, repo_copy.schemas / "prd.schema.json", repo_copy.evidence)


def test_timeout_kills_the_command(repo_copy: RepoPaths, edit_story: Any) -> None:
    set_evidence(edit_story, "DGR-017", cmd("slow", "sleep 60 & sleep 60", timeout_s=1))
    outcome, _ = run(repo_copy, "DGR-017")
    record = outcome.record.commands[0]
    assert record.result is Result.FAIL and record.reason == "timed out after 1 s"
    assert record.duration_s < 20


def test_logs_are_trimmed(repo_copy: RepoPaths, edit_story: Any) -> None:
    set_evidence(edit_story, "DGR-017", cmd("noisy", "seq 1 1000"))
    outcome, _ = run(repo_copy, "DGR-017")
    lines = (outcome.run_dir / "noisy.log").read_text().splitlines()
    assert lines[:2] == ["1", "2"] and lines[-1] == "1000"
    assert f"... [{1000 - runner.LOG_HEAD_LINES - runner.LOG_TAIL_LINES} lines trimmed] ..." in (
        lines
    )


def test_metrics_must_be_a_json_object(repo_copy: RepoPaths, edit_story: Any) -> None:
    set_evidence(edit_story, "DGR-017", cmd("bad", "echo '[1, 2]' > \"$DGR_METRICS\""))
    outcome, _ = run(repo_copy, "DGR-017")
    assert outcome.record.reason == "bad: metrics file does not hold a JSON object"


def test_cli_exit_codes(repo_copy: RepoPaths, edit_story: Any) -> None:
    edit_story("DGR-018", lambda s: s.update(status="todo", passes=False))
    refused = subprocess.run(
        ["dgr-prd", "run-story", "DGR-019"], capture_output=True, text=True, check=False
    )
    assert refused.returncode == runner.EXIT_REFUSED
    assert "REFUSED" in refused.stderr and "DGR-018 (todo)" in refused.stderr
    unknown = subprocess.run(
        ["dgr-prd", "run-story", "DGR-099"], capture_output=True, text=True, check=False
    )
    assert unknown.returncode == runner.EXIT_REFUSED and "no story DGR-099" in unknown.stderr
    repo_copy.prd.write_text("{}")
    invalid = subprocess.run(["dgr-prd", "validate"], capture_output=True, text=True, check=False)
    assert invalid.returncode == runner.EXIT_INVALID_PRD
    assert "prd.json is invalid" in invalid.stderr


def test_latest_record_round_trips(repo_copy: RepoPaths, edit_story: Any) -> None:
    set_evidence(edit_story, "DGR-017", cmd("check", "true"))
    outcome, _ = run(repo_copy, "DGR-017")
    assert latest_record(repo_copy.evidence, "DGR-017") == outcome.record
    assert Path(outcome.run_dir).parent.name == "DGR-017"
