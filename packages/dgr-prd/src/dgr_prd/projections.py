"""Views generated from prd.json: PRD.md, stories/DGR-0NN.md and RALPH-CONTEXT.md's status.

`nox -s prd` writes them; a test fails when the committed copies are stale.
"""

from __future__ import annotations

from pathlib import Path

from dgr_prd.evidence import latest_record
from dgr_prd.model import Prd, Story
from dgr_prd.paths import RepoPaths
from dgr_prd.perf import render_perf

GENERATED_NOTE = "<!-- Generated from prd.json by `nox -s prd`; edit prd.json, not this file. -->"
STATUS_BEGIN = "<!-- BEGIN GENERATED STATUS (nox -s prd) -->"
STATUS_END = "<!-- END GENERATED STATUS -->"


def _evidence_lines(story: Story) -> list[str]:
    lines = []
    for c in story.evidence:
        flags = [c.lane.value, "required" if c.required else "optional"]
        if not c.implemented:
            flags.append("not implemented yet")
        lines.append(f"- `{c.name}` ({', '.join(flags)}): `{c.run}`")
    return lines


def story_body(story: Story, heading: str = "#") -> list[str]:
    deps = ", ".join(story.depends_on) or "none"
    lines = [
        f"{heading} {story.id}: {story.title}",
        "",
        f"- Milestone: {story.milestone}; gate: {story.gate.value}; target: `{story.target}`",
        f"- Depends on: {deps}",
        f"- Status: {story.status.value} (passes: {str(story.passes).lower()})",
        "",
        story.description,
        "",
        "Acceptance:",
        "",
        *[f"- {a}" for a in story.acceptance],
        "",
        "Evidence:",
        "",
        *_evidence_lines(story),
        "",
    ]
    if story.notes:
        lines += [f"Notes: {story.notes}", ""]
    return lines


def render_story(story: Story) -> str:
    return "\n".join(
        [GENERATED_NOTE, "", *story_body(story), f"Run: `nox -s story-{story.id}`", ""]
    )


def render_prd_md(prd: Prd) -> str:
    lines = [GENERATED_NOTE, "", f"# {prd.project}", "", prd.summary, "", "## Goals", ""]
    lines += [f"- {g}" for g in prd.goals]
    lines += ["", "## Locked scope", ""] + [f"- {s}" for s in prd.locked_scope]
    lines += ["", "## Gates", ""]
    for gate in prd.gates:
        lines += [f"### {gate.id.value}", "", gate.description, ""]
        if gate.thresholds:
            lines += ["| metric | threshold | meaning |", "|---|---|---|"]
            lines += [
                f"| `{t.metric}` | {t.op} {t.value:g} | {t.meaning} |" for t in gate.thresholds
            ]
            lines.append("")
    lines += ["## Milestones", ""]
    for m in prd.milestones:
        stories = [s for s in prd.stories if s.milestone == m.id]
        lines += [
            f"### {m.id}: {m.title}",
            "",
            m.goal,
            "",
            "| id | title | gate | status |",
            "|---|---|---|---|",
        ]
        lines += [f"| {s.id} | {s.title} | {s.gate.value} | {s.status.value} |" for s in stories]
        lines.append("")
    lines += ["## Stories", ""]
    for story in prd.stories:
        lines += story_body(story, "###")
    return "\n".join(lines)


def render_status(prd: Prd, evidence_root: Path) -> str:
    lines = [
        STATUS_BEGIN,
        "",
        "| story | title | status | last result | last run (UTC) | lanes |",
        "|---|---|---|---|---|---|",
    ]
    for s in prd.stories:
        record = latest_record(evidence_root, s.id)
        result = record.result.value if record else "-"
        when = record.finished_utc if record else "-"
        lanes = ", ".join(sorted({c.lane.value for c in s.evidence}))
        lines.append(f"| {s.id} | {s.title} | {s.status.value} | {result} | {when} | {lanes} |")
    lines += ["", STATUS_END]
    return "\n".join(lines)


def refresh_ralph(text: str, status: str) -> str:
    if STATUS_BEGIN not in text or STATUS_END not in text:
        raise ValueError("RALPH-CONTEXT.md lacks the generated status markers")
    head, _, rest = text.partition(STATUS_BEGIN)
    _, _, tail = rest.partition(STATUS_END)
    return head + status + tail


def expected_projections(paths: RepoPaths, prd: Prd) -> dict[Path, str]:
    files = {paths.prd_md: render_prd_md(prd)}
    for story in prd.stories:
        files[paths.stories / f"{story.id}.md"] = render_story(story)
    ralph = paths.ralph.read_text(encoding="utf-8")
    files[paths.ralph] = refresh_ralph(ralph, render_status(prd, paths.evidence))
    files[paths.docs / "perf.md"] = render_perf(paths)
    return files


def write_projections(paths: RepoPaths, prd: Prd) -> list[Path]:
    paths.stories.mkdir(exist_ok=True)
    changed = []
    for path, text in expected_projections(paths, prd).items():
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            changed.append(path)
    return changed


def stale_projections(paths: RepoPaths, prd: Prd) -> list[str]:
    stale = [
        str(p.relative_to(paths.root))
        for p, text in expected_projections(paths, prd).items()
        if not p.is_file() or p.read_text(encoding="utf-8") != text
    ]
    expected = {f"{s.id}.md" for s in prd.stories}
    stale += [
        f"stories/{p.name} (not a story)"
        for p in paths.stories.glob("*.md")
        if p.name not in expected
    ]
    return stale
