"""evidence/DGR-0NN/<run-id>/evidence.json: the record a story run leaves behind."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from dgr_prd.model import Lane, StoryId

LATEST = "LATEST"
EVIDENCE_FILE = "evidence.json"
HANDOFF_FILE = "handoff.md"


class Result(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    SKIPPED = "skipped"


class CommandRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    run: str
    lane: Lane
    required: bool
    result: Result
    exit_code: int | None = Field(description="None when the command did not run.")
    duration_s: float
    reason: str = ""
    log: str | None = Field(default=None, description="Trimmed log file, relative to the run.")
    metrics: dict[str, Any] = Field(default_factory=dict)


class GitState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    commit: str | None
    dirty: bool


class EvidenceRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: int = 1
    story: StoryId
    title: str
    run_id: str
    started_utc: str
    finished_utc: str
    git: GitState
    lanes_available: list[Lane]
    hardware: dict[str, Any]
    llama_cpp_pin: dict[str, Any] | None = Field(
        default=None, description="From native/llama.cpp/manifest.json once it exists."
    )
    patch_stack_sha256: str | None = None
    dependency_override: list[StoryId] = Field(
        default_factory=list,
        description="Dependencies that were not done but overridden with --override-deps.",
    )
    commands: list[CommandRecord]
    metrics: dict[str, Any] = Field(default_factory=dict)
    result: Result
    reason: str


def story_dir(evidence_root: Path, story_id: str) -> Path:
    return evidence_root / story_id


def latest_run_dir(evidence_root: Path, story_id: str) -> Path | None:
    pointer = story_dir(evidence_root, story_id) / LATEST
    if not pointer.is_file():
        return None
    run_id = pointer.read_text(encoding="utf-8").strip()
    run = story_dir(evidence_root, story_id) / run_id
    return run if (run / EVIDENCE_FILE).is_file() else None


def load_record(run_dir: Path) -> EvidenceRecord:
    return EvidenceRecord.model_validate_json((run_dir / EVIDENCE_FILE).read_text("utf-8"))


def latest_record(evidence_root: Path, story_id: str) -> EvidenceRecord | None:
    run = latest_run_dir(evidence_root, story_id)
    return None if run is None else load_record(run)


def all_records(evidence_root: Path, story_id: str) -> list[EvidenceRecord]:
    """Every recorded run of a story, oldest first."""
    base = story_dir(evidence_root, story_id)
    if not base.is_dir():
        return []
    records = [load_record(p) for p in sorted(base.iterdir()) if (p / EVIDENCE_FILE).is_file()]
    return sorted(records, key=lambda r: r.started_utc)


def latest_decisive_record(evidence_root: Path, story_id: str) -> EvidenceRecord | None:
    """The newest run that passed or failed; skipped runs (missing lane) prove nothing."""
    decisive = [r for r in all_records(evidence_root, story_id) if r.result is not Result.SKIPPED]
    return decisive[-1] if decisive else None


def write_record(run_dir: Path, record: EvidenceRecord) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record.model_dump(mode="json"), indent=2, ensure_ascii=False) + "\n"
    (run_dir / EVIDENCE_FILE).write_text(text, encoding="utf-8")


def point_latest(evidence_root: Path, story_id: str, run_id: str) -> None:
    pointer = story_dir(evidence_root, story_id) / LATEST
    tmp = pointer.with_suffix(".tmp")
    tmp.write_text(run_id + "\n", encoding="utf-8")
    tmp.replace(pointer)
