"""The prd.json backlog as pydantic models: the single source of truth for its JSON Schema."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

StoryId = Annotated[str, StringConstraints(pattern=r"^DGR-0[1-9][0-9]$")]
MilestoneId = Annotated[str, StringConstraints(pattern=r"^M[0-9]+$")]
CommandName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9-]*$")]


class Status(StrEnum):
    TODO = "todo"
    IN_PROGRESS = "in_progress"
    BLOCKED = "blocked"
    DONE = "done"


class Gate(StrEnum):
    ALPHA = "alpha"
    BETA = "beta"


class Lane(StrEnum):
    """Hardware lanes an evidence command can need; see dgr_prd.lanes for detection."""

    CPU = "cpu"
    CUDA = "cuda"
    ROCM = "rocm"
    VULKAN = "vulkan"
    METAL = "metal"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EvidenceCommand(_Strict):
    """One command a story's nox session runs as evidence."""

    name: CommandName = Field(description="Short, unique within the story; names the log file.")
    run: str = Field(min_length=1, description="Shell command, run from the repository root.")
    lane: Lane = Field(description="The hardware lane the command needs.")
    required: bool = Field(
        default=True, description="A story is done only when every required command passed."
    )
    implemented: bool = Field(
        description="False while the command is planned but not built: the runner then fails "
        "the story honestly with 'evidence not implemented' instead of running it."
    )
    timeout_s: int = Field(default=1800, ge=1, le=5400)


class Story(_Strict):
    id: StoryId
    title: str = Field(min_length=1)
    description: str = Field(min_length=1)
    milestone: MilestoneId
    target: str = Field(min_length=1, description="Package under packages/ or native component.")
    depends_on: list[StoryId] = Field(default_factory=list)
    acceptance: list[str] = Field(min_length=1, description="Checkable sentences.")
    evidence: list[EvidenceCommand] = Field(min_length=1)
    gate: Gate
    status: Status = Status.TODO
    passes: bool = False
    notes: str = ""


class Milestone(_Strict):
    id: MilestoneId
    title: str
    goal: str


class GateThreshold(_Strict):
    metric: str = Field(description="Metric name as evidence JSON reports it.")
    op: str = Field(pattern=r"^(>=|<=|==)$")
    value: float
    meaning: str
    compute_threads: int | None = Field(
        default=None,
        ge=1,
        description="The host condition: compute threads running at the same time while the "
        "row is measured (stages, or RPC servers and their client; the single-process "
        "reference is timed apart). The row is measurable only on a host with at least that "
        "many cores, each stage pinned to its own; elsewhere it is not_measurable_here, never a "
        "pass. None: measurable anywhere.",
    )


class GateDefinition(_Strict):
    id: Gate
    description: str
    thresholds: list[GateThreshold] = Field(default_factory=list)


class Prd(_Strict):
    schema_version: int = Field(ge=1)
    project: str
    summary: str
    goals: list[str] = Field(min_length=1)
    locked_scope: list[str] = Field(min_length=1)
    gates: list[GateDefinition] = Field(min_length=1)
    milestones: list[Milestone] = Field(min_length=1)
    stories: list[Story] = Field(min_length=1)

    def story(self, story_id: str) -> Story:
        for story in self.stories:
            if story.id == story_id:
                return story
        raise KeyError(f"no story {story_id} in prd.json")

    def milestone(self, milestone_id: str) -> Milestone:
        for milestone in self.milestones:
            if milestone.id == milestone_id:
                return milestone
        raise KeyError(f"no milestone {milestone_id} in prd.json")


def load_prd(path: Path) -> Prd:
    return Prd.model_validate_json(path.read_text(encoding="utf-8"))


def dump_prd(prd: Prd, path: Path) -> None:
    """Write prd.json in its canonical form (stable key order, 2-space indent, newline)."""
    # the keys prd.json holds and those a tool set: an optional field left out stays out
    data = prd.model_dump(mode="json", exclude_unset=True)
    text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
