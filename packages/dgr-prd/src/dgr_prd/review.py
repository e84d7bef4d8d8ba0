"""`dgr-prd gate-review alpha`: the gate's review, generated from committed evidence only.

For every threshold of the gate: the metric, the threshold, the latest value with the evidence
it came from (record or file, commit, dirty flag) and its host (cores, CPU model, lane), and the
verdict: pass, a miss, or not measurable on that host (the host condition, dgr_prd.gate). Then
every story of the gate with its status and latest decisive evidence record. The review passes
only when every threshold passes on a host that meets its condition, every story of the gate is
done with a passing latest record made from a clean tree, and the tree it runs from is clean;
the stories whose evidence is this review are not counted among those it reviews.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

from dgr_prd import gate as gates
from dgr_prd.evidence import Result, latest_decisive_record
from dgr_prd.model import Prd, Status
from dgr_prd.paths import RepoPaths


@dataclass(frozen=True)
class StoryRow:
    story: str
    title: str
    status: str
    result: str  # the latest decisive record's result, or "-" without one
    run: str
    commit: str
    dirty: bool | None

    @property
    def passed(self) -> bool:
        """Done, its latest decisive record a pass, from a committed tree."""
        return (
            self.status == Status.DONE.value
            and self.result == Result.PASS.value
            and self.dirty is False
        )


@dataclass(frozen=True)
class Review:
    gate: str
    thresholds: list[gates.GateRow]
    stories: list[StoryRow]
    clean_tree: bool

    @property
    def passed(self) -> bool:
        return (
            self.clean_tree
            and all(r.passed for r in self.thresholds)
            and all(s.passed for s in self.stories)
        )


def tree_is_clean(paths: RepoPaths) -> bool:
    done = subprocess.run(
        ["git", "status", "--porcelain"],
        cwd=paths.root,
        capture_output=True,
        text=True,
        check=False,
    )
    return done.returncode == 0 and not done.stdout.strip()


def review(paths: RepoPaths, prd: Prd, gate_id: str) -> Review:
    rows = gates.evaluate(paths, prd, gate_id)
    stories = []
    for s in prd.stories:
        if s.gate.value != gate_id or any("gate-review" in e.run for e in s.evidence):
            continue
        record = latest_decisive_record(paths.evidence, s.id)
        stories.append(
            StoryRow(
                s.id,
                s.title,
                s.status.value,
                record.result.value if record else "-",
                record.run_id if record else "-",
                (record.git.commit or "-")[:12] if record else "-",
                record.git.dirty if record else None,
            )
        )
    return Review(gate_id, rows, stories, tree_is_clean(paths))


def story_table(stories: list[StoryRow]) -> list[str]:
    lines = [
        "| story | title | status | latest evidence | result | commit | tree |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in stories:
        lines.append(
            f"| {s.story} | {s.title} | {s.status} | {s.run} | {s.result} | {s.commit} | "
            f"{gates.tree_text(s.dirty)} |"
        )
    return lines


def render(r: Review) -> list[str]:
    thresholds_passed = sum(t.passed for t in r.thresholds)
    unmeasurable = sum(t.unmeasurable is not None for t in r.thresholds)
    stories_passed = sum(s.passed for s in r.stories)
    return [
        f"Gate {r.gate}: {'PASSES' if r.passed else 'does not pass'}. "
        f"{thresholds_passed} of {len(r.thresholds)} thresholds pass ({unmeasurable} not "
        f"measurable on the host of their evidence); {stories_passed} of {len(r.stories)} "
        f"stories done with a passing latest record; tree "
        f"{'clean' if r.clean_tree else 'dirty'}.",
        "",
        *gates.table(r.thresholds),
        "",
        *story_table(r.stories),
    ]
