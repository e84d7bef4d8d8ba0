"""Validation of prd.json: JSON Schema first, then the rules a schema cannot express."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
from pydantic import ValidationError

from dgr_prd.evidence import Result, latest_decisive_record
from dgr_prd.model import Gate, Prd, Status

FIRST_STORY = 17
LAST_STORY = 71
EXPECTED_IDS = [f"DGR-{n:03d}" for n in range(FIRST_STORY, LAST_STORY + 1)]


@dataclass(frozen=True)
class PrdIssue:
    """One problem in prd.json, naming the story (or '-') and the field."""

    story: str
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.story}: {self.field}: {self.message}"


class PrdInvalid(Exception):
    def __init__(self, issues: list[PrdIssue]) -> None:
        self.issues = issues
        super().__init__("prd.json is invalid:\n" + "\n".join(f"  - {i}" for i in issues))


def schema_issues(data: Any, schema: dict[str, Any]) -> list[PrdIssue]:
    validator = jsonschema.Draft202012Validator(schema)
    issues: list[PrdIssue] = []
    for error in sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path)):
        path = list(error.absolute_path)
        story = "-"
        if len(path) >= 2 and path[0] == "stories" and isinstance(path[1], int):
            stories = data.get("stories", []) if isinstance(data, dict) else []
            entry = stories[path[1]] if path[1] < len(stories) else {}
            story = str(entry.get("id", f"stories[{path[1]}]")) if isinstance(entry, dict) else "-"
            path = path[2:]
        field = ".".join(str(p) for p in path) or "(root)"
        issues.append(PrdIssue(story, field, error.message))
    return issues


def _cycle_issues(prd: Prd) -> list[PrdIssue]:
    deps = {s.id: [d for d in s.depends_on if d != s.id] for s in prd.stories}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = finished
    issues: list[PrdIssue] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in deps.get(node, []):
            if dep not in deps:
                continue
            if state.get(dep) == 1:
                cycle = [*stack[stack.index(dep) :], dep]
                issues.append(
                    PrdIssue(node, "depends_on", "dependency cycle: " + " -> ".join(cycle))
                )
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for story_id in deps:
        if story_id not in state:
            visit(story_id, [story_id])
    return issues


def semantic_issues(prd: Prd, evidence_root: Path | None) -> list[PrdIssue]:
    issues: list[PrdIssue] = []
    ids = [s.id for s in prd.stories]
    seen: set[str] = set()
    for story_id in ids:
        if story_id in seen:
            issues.append(PrdIssue(story_id, "id", "duplicate story id"))
        seen.add(story_id)
    for story_id in sorted(seen - set(EXPECTED_IDS)):
        issues.append(PrdIssue(story_id, "id", "unknown story id (backlog is DGR-017..DGR-071)"))
    for story_id in [i for i in EXPECTED_IDS if i not in seen]:
        issues.append(PrdIssue(story_id, "id", "story missing from prd.json"))
    if not issues and ids != EXPECTED_IDS:
        issues.append(PrdIssue("-", "stories", "stories are not in backlog order"))

    milestone_rank = {m.id: n for n, m in enumerate(prd.milestones)}
    by_id = {s.id: s for s in prd.stories}
    for story in prd.stories:
        if story.milestone not in milestone_rank:
            issues.append(PrdIssue(story.id, "milestone", f"unknown milestone {story.milestone}"))
        names = [c.name for c in story.evidence]
        for name in sorted({n for n in names if names.count(n) > 1}):
            issues.append(PrdIssue(story.id, "evidence", f"duplicate command name {name!r}"))
        for dep in story.depends_on:
            if dep == story.id:
                issues.append(PrdIssue(story.id, "depends_on", "a story cannot depend on itself"))
            elif dep not in by_id:
                issues.append(PrdIssue(story.id, "depends_on", f"unknown story {dep}"))
            else:
                target = by_id[dep]
                later = milestone_rank.get(target.milestone, -1) > milestone_rank.get(
                    story.milestone, -1
                )
                if story.gate is Gate.ALPHA and target.gate is Gate.BETA and later:
                    issues.append(
                        PrdIssue(
                            story.id,
                            "depends_on",
                            f"alpha story depends on {dep}, a beta story of later milestone "
                            f"{target.milestone}",
                        )
                    )
        if (story.status is Status.DONE) != story.passes:
            issues.append(
                PrdIssue(
                    story.id,
                    "passes",
                    f"status {story.status.value!r} disagrees with passes={story.passes}",
                )
            )
        if story.passes and evidence_root is not None:
            record = latest_decisive_record(evidence_root, story.id)
            if record is None:
                issues.append(
                    PrdIssue(story.id, "passes", "passes is true but no evidence record exists")
                )
            elif record.result is not Result.PASS or record.dependency_override:
                issues.append(
                    PrdIssue(
                        story.id,
                        "passes",
                        f"passes is true but the latest evidence ({record.run_id}) is "
                        f"{record.result.value}"
                        + (" with overridden dependencies" if record.dependency_override else ""),
                    )
                )
    issues.extend(_cycle_issues(prd))
    return issues


def validate_file(prd_path: Path, schema_path: Path, evidence_root: Path | None) -> Prd:
    """Load and fully validate prd.json; raise PrdInvalid listing every problem found."""
    try:
        data = json.loads(prd_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise PrdInvalid([PrdIssue("-", "(file)", f"not valid JSON: {exc}")]) from exc
    schema = json.loads(schema_path.read_text(encoding="utf-8"))
    issues = schema_issues(data, schema)
    if issues:
        raise PrdInvalid(issues)
    try:
        prd = Prd.model_validate(data)
    except ValidationError as exc:  # the schema should have caught it; keep the message typed
        raise PrdInvalid([PrdIssue("-", str(e["loc"]), e["msg"]) for e in exc.errors()]) from exc
    issues = semantic_issues(prd, evidence_root)
    if issues:
        raise PrdInvalid(issues)
    return prd
