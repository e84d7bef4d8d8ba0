"""handoff.md: what a story run did, what it showed, what is left, how to reproduce it."""

from __future__ import annotations

from typing import Any

from dgr_prd.evidence import EvidenceRecord, Result
from dgr_prd.model import Prd, Status, Story


def hardware_line(hardware: dict[str, Any]) -> str:
    cpu = hardware.get("cpu", {})
    mem = hardware.get("memory_bytes")
    gpus = hardware.get("gpus") or []
    gpu_text = ", ".join(f"{g['name']} (driver {g['driver']})" for g in gpus) or "no GPU"
    mem_text = f"{mem / 2**30:.1f} GiB" if isinstance(mem, int) else "unknown memory"
    return (
        f"{cpu.get('model', '?')}, {cpu.get('cores', '?')} cores, {mem_text}, {gpu_text}; "
        f"{hardware.get('os', {}).get('distribution', '?')}; Python {hardware.get('python')}"
    )


def flatten_metrics(metrics: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows.extend(flatten_metrics(value, name + "."))
        else:
            rows.append((name, value))
    return rows


def unblocked_by(prd: Prd, story: Story) -> list[Story]:
    return [
        s
        for s in prd.stories
        if story.id in s.depends_on
        and s.status is not Status.DONE
        and all(prd.story(d).status is Status.DONE for d in s.depends_on)
    ]


def render_handoff(prd: Prd, story: Story, record: EvidenceRecord) -> str:
    lines = [
        f"# Handoff: {story.id} {story.title}",
        "",
        f"Run `{record.run_id}`, {record.started_utc} to {record.finished_utc}: "
        f"**{record.result.value}** ({record.reason}).",
        "",
        f"- Commit: `{record.git.commit or 'none'}`{' (dirty tree)' if record.git.dirty else ''}",
        f"- Hardware: {hardware_line(record.hardware)}",
        f"- Lanes here: {', '.join(lane.value for lane in record.lanes_available)}",
        f"- Status after the run: {story.status.value} (passes: {str(story.passes).lower()})",
    ]
    if record.dependency_override:
        lines.append(f"- Dependencies overridden: {', '.join(record.dependency_override)}")
    lines += [
        "",
        "## What ran",
        "",
        "| command | lane | result | exit | seconds | reason |",
        "|---|---|---|---|---|---|",
    ]
    for c in record.commands:
        exit_text = "-" if c.exit_code is None else str(c.exit_code)
        lines.append(
            f"| `{c.name}` | {c.lane.value} | {c.result.value} | {exit_text} | "
            f"{c.duration_s:.1f} | {c.reason or '-'} |"
        )
    lines += ["", "## What it showed", ""]
    rows = flatten_metrics(record.metrics)
    if rows:
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| `{k}` | {v} |" for k, v in rows]
    else:
        lines.append("No metrics were reported; the exit codes above are the evidence.")
    lines += ["", "## What is left", ""]
    left = [
        f"- `{c.name}`: {c.result.value}, {c.reason}"
        for c in record.commands
        if c.result is not Result.PASS
    ]
    if record.result is Result.PASS:
        nxt = unblocked_by(prd, story)
        if nxt:
            left.append("- Now unblocked: " + ", ".join(f"{s.id} ({s.title})" for s in nxt))
    if story.notes:
        left.append(f"- Notes: {story.notes}")
    lines += left or ["- Nothing for this story."]
    lines += ["", "## Reproduce", "", "```bash", f"nox -s story-{story.id}"]
    lines += [f"{c.run}  # {c.name}, lane {c.lane.value}" for c in record.commands]
    lines += ["```", ""]
    return "\n".join(lines)
