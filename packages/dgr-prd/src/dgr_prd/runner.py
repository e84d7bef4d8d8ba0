"""The story runner: the only writer of story status in prd.json.

`nox -s story-DGR-0NN` calls run_story(): validate prd.json, check dependencies, fingerprint the
hardware, run each evidence command on the lanes this machine has (streaming its output), write
evidence/DGR-0NN/<run-id>/{evidence.json,handoff.md,*.log}, point LATEST at the run, update the
story's status, and refresh the projections.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from dgr_records import git_state as records_git_state

from dgr_prd.evidence import (
    CommandRecord,
    EvidenceRecord,
    GitState,
    Result,
    point_latest,
    story_dir,
    write_record,
)
from dgr_prd.handoff import render_handoff
from dgr_prd.hardware import fingerprint
from dgr_prd.lanes import available_lanes, missing_lane_reason
from dgr_prd.model import EvidenceCommand, Lane, Prd, Status, Story, dump_prd
from dgr_prd.native_pin import llama_pin, patch_stack_hash
from dgr_prd.paths import RepoPaths
from dgr_prd.projections import write_projections
from dgr_prd.validate import validate_file

LOG_HEAD_LINES = 40
LOG_TAIL_LINES = 120

EXIT_PASS = 0
EXIT_FAIL = 1
EXIT_INVALID_PRD = 2
EXIT_REFUSED = 3
EXIT_SKIPPED = 5


class DependenciesNotDone(Exception):
    def __init__(self, story: Story, pending: list[tuple[str, Status]]) -> None:
        self.story = story
        self.pending = pending
        listing = ", ".join(f"{dep} ({status.value})" for dep, status in pending)
        super().__init__(
            f"{story.id} refused: dependencies not done: {listing}. Run those stories first, "
            f"or pass --override-deps to run anyway (recorded in the evidence; the story "
            f"cannot become done that way)."
        )


@dataclass
class RunOutcome:
    record: EvidenceRecord
    run_dir: Path
    exit_code: int


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_run_id() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(3)


def git_state(root: Path) -> GitState:
    return GitState(**records_git_state(root))


def _trim_log(full_log: Path, out: Path) -> None:
    head: list[str] = []
    tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
    total = 0
    with full_log.open(encoding="utf-8", errors="replace") as fh:
        for line in fh:
            total += 1
            if len(head) < LOG_HEAD_LINES:
                head.append(line)
            else:
                tail.append(line)
    dropped = total - len(head) - len(tail)
    marker = [f"... [{dropped} lines trimmed] ...\n"] if dropped > 0 else []
    out.write_text("".join(head + marker + list(tail)), encoding="utf-8")


def _read_metrics(path: Path) -> tuple[dict[str, Any], str]:
    if not path.is_file() or path.stat().st_size == 0:
        return {}, ""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        return {}, f"metrics file is not valid JSON: {exc}"
    if not isinstance(data, dict):
        return {}, "metrics file does not hold a JSON object"
    return data, ""


def run_command(
    command: EvidenceCommand, root: Path, run_dir: Path, story_id: str, stream: TextIO
) -> CommandRecord:
    """Run one evidence command through bash, streaming its output and keeping a trimmed log."""
    stream.write(f"\n==> [{story_id}] {command.name} ({command.lane.value}): {command.run}\n")
    stream.flush()
    with tempfile.TemporaryDirectory(prefix="dgr-evidence-") as tmp:
        metrics_path = Path(tmp) / "metrics.json"
        full_log = Path(tmp) / "full.log"
        env = {
            **os.environ,
            "DGR_METRICS": str(metrics_path),
            "DGR_STORY": story_id,
            "DGR_RUN_DIR": str(run_dir),
            "PYTHONUNBUFFERED": "1",
        }
        start = time.monotonic()
        proc = subprocess.Popen(
            ["bash", "-c", command.run],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        timed_out = threading.Event()

        def kill() -> None:
            timed_out.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(command.timeout_s, kill)
        timer.start()
        assert proc.stdout is not None
        with full_log.open("wb") as log:
            for chunk in iter(proc.stdout.readline, b""):
                log.write(chunk)
                stream.write(chunk.decode("utf-8", errors="replace"))
                stream.flush()
        exit_code = proc.wait()
        timer.cancel()
        duration = round(time.monotonic() - start, 3)
        log_name = f"{command.name}.log"
        _trim_log(full_log, run_dir / log_name)
        metrics, metrics_error = _read_metrics(metrics_path)

    reason = ""
    if timed_out.is_set():
        reason = f"timed out after {command.timeout_s} s"
    elif exit_code != 0:
        reason = f"exit code {exit_code}"
    elif metrics_error:
        reason = metrics_error
    result = Result.PASS if not reason else Result.FAIL
    stream.write(
        f"<== [{story_id}] {command.name}: {result.value}"
        f"{' (' + reason + ')' if reason else ''} in {duration:.1f} s\n"
    )
    return CommandRecord(
        name=command.name,
        run=command.run,
        lane=command.lane,
        required=command.required,
        result=result,
        exit_code=exit_code,
        duration_s=duration,
        reason=reason,
        log=log_name,
        metrics=metrics,
    )


def _not_run(command: EvidenceCommand, result: Result, reason: str) -> CommandRecord:
    return CommandRecord(
        name=command.name,
        run=command.run,
        lane=command.lane,
        required=command.required,
        result=result,
        exit_code=None,
        duration_s=0.0,
        reason=reason,
    )


def overall(commands: list[CommandRecord]) -> tuple[Result, str]:
    required = [c for c in commands if c.required]
    failed = [c for c in required if c.result is Result.FAIL]
    skipped = [c for c in required if c.result is Result.SKIPPED]
    if failed:
        return Result.FAIL, "; ".join(f"{c.name}: {c.reason}" for c in failed)
    if skipped:
        return Result.SKIPPED, "; ".join(f"{c.name}: {c.reason}" for c in skipped)
    return Result.PASS, f"all {len(required)} required evidence commands passed"


def next_status(story: Story, result: Result, overridden: bool) -> tuple[Status, bool]:
    """Status and passes after a run. Only a clean pass (no overridden dependency, run from a
    committed tree) makes a story done; any other decisive run takes passes away. A skipped run
    (missing lane) proves nothing either way and leaves the story as it was."""
    if result is Result.SKIPPED:
        return story.status, story.passes
    if result is Result.PASS and not overridden:
        return Status.DONE, True
    return (Status.IN_PROGRESS if story.status is Status.DONE else story.status), False


def pending_dependencies(prd: Prd, story: Story) -> list[tuple[str, Status]]:
    return [
        (d, prd.story(d).status) for d in story.depends_on if prd.story(d).status is not Status.DONE
    ]


def run_story(
    paths: RepoPaths,
    story_id: str,
    *,
    override_deps: bool = False,
    stream: TextIO = sys.stdout,
) -> RunOutcome:
    prd = validate_file(paths.prd, paths.schemas / "prd.schema.json", paths.evidence)
    story = prd.story(story_id)
    pending = pending_dependencies(prd, story)
    if pending and not override_deps:
        raise DependenciesNotDone(story, pending)

    hardware = fingerprint()
    lanes = available_lanes(hardware)
    run_id = new_run_id()
    run_dir = story_dir(paths.evidence, story.id) / run_id
    run_dir.mkdir(parents=True)
    started = utc_now()
    git = git_state(paths.root)
    stream.write(
        f"DGR story runner: {story.id} {story.title}\n  run {run_id}; lanes here: "
        f"{', '.join(lane.value for lane in lanes)}\n"
    )
    if pending:
        stream.write(
            "  WARNING: dependencies overridden: "
            + ", ".join(f"{d} ({s.value})" for d, s in pending)
            + "\n"
        )

    commands: list[CommandRecord] = []
    for command in story.evidence:
        if not command.implemented:
            commands.append(
                _not_run(
                    command, Result.FAIL, f"evidence not implemented yet (planned: {command.run})"
                )
            )
            stream.write(f"\n==> [{story.id}] {command.name}: evidence not implemented yet\n")
        elif Lane(command.lane) not in lanes:
            commands.append(
                _not_run(
                    command,
                    Result.SKIPPED,
                    f"lane {command.lane.value} unavailable: {missing_lane_reason(command.lane)}",
                )
            )
            stream.write(
                f"\n==> [{story.id}] {command.name}: skipped, no {command.lane.value} lane here\n"
            )
        else:
            commands.append(run_command(command, paths.root, run_dir, story.id, stream))

    result, reason = overall(commands)
    if pending and result is Result.PASS:
        reason += "; dependencies were overridden, so the story is not marked done"
    if git.dirty and result is Result.PASS:
        # passing evidence names a commit that holds exactly what ran
        reason += (
            "; the tree had uncommitted changes, so the story is not marked done"
            " (commit, then run it again)"
        )
    record = EvidenceRecord(
        story=story.id,
        title=story.title,
        run_id=run_id,
        started_utc=started,
        finished_utc=utc_now(),
        git=git,
        lanes_available=lanes,
        hardware=hardware,
        llama_cpp_pin=llama_pin(paths.llama_manifest),
        patch_stack_sha256=patch_stack_hash(paths.patches),
        dependency_override=[d for d, _ in pending],
        commands=commands,
        metrics={c.name: c.metrics for c in commands if c.metrics},
        result=result,
        reason=reason,
    )
    write_record(run_dir, record)
    status, passes = next_status(story, result, bool(pending) or git.dirty)
    story.status, story.passes = status, passes
    dump_prd(prd, paths.prd)
    (run_dir / "handoff.md").write_text(render_handoff(prd, story, record), encoding="utf-8")
    point_latest(paths.evidence, story.id, run_id)
    write_projections(paths, prd)
    stream.write(
        f"\n{story.id}: {result.value} - {reason}\n  status now {status.value}; "
        f"evidence in {run_dir.relative_to(paths.root)}\n"
    )
    code = {Result.PASS: EXIT_PASS, Result.FAIL: EXIT_FAIL, Result.SKIPPED: EXIT_SKIPPED}[result]
    return RunOutcome(record=record, run_dir=run_dir, exit_code=code)
