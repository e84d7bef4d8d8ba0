"""`dgr-prd gate` and `gate-review`: prd.json's thresholds against the newest evidence, on a copy
of the repository whose bench files the tests write; a miss says by how much, missing evidence is
a miss, and a row measured on a host without the cores its compute threads need (the host
condition) is not_measurable_here, never a pass."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

from dgr_prd.gate import evaluate
from dgr_prd.model import load_prd
from dgr_prd.paths import RepoPaths


def no_evidence(repo: RepoPaths) -> None:
    """The copy starts without any evidence: the test writes exactly what it reads."""
    shutil.rmtree(repo.evidence)
    repo.evidence.mkdir()


BIG_HOST = {"cpu": {"cores": 16, "model": "test CPU"}}


def write_bench(
    repo: RepoPaths,
    name: str,
    when: str,
    metrics: dict[str, Any],
    host: dict[str, Any] | None = BIG_HOST,
) -> None:
    bench = repo.evidence / "bench"
    bench.mkdir(parents=True, exist_ok=True)
    body: dict[str, Any] = {"measured_utc": when, "gate_metrics": metrics}
    if host is not None:
        body["host"] = host
        body["git"] = {"commit": "ab" * 20, "dirty": False}
    (bench / name).write_text(json.dumps(body))


def test_the_newest_evidence_decides_and_a_miss_says_by_how_much(repo_copy: RepoPaths) -> None:
    no_evidence(repo_copy)
    write_bench(
        repo_copy, "a.json", "2030-01-01T00:00:00Z", {"bench": {"decode_ratio_3stage_vs_rpc": 2.0}}
    )
    write_bench(
        repo_copy, "b.json", "2030-01-02T00:00:00Z", {"bench": {"decode_ratio_3stage_vs_rpc": 1.5}}
    )
    rows = {r.metric: r for r in evaluate(repo_copy, load_prd(repo_copy.prd), "alpha")}
    rpc = rows["bench.decode_ratio_3stage_vs_rpc"]
    assert rpc.measured is not None and rpc.measured.value == 1.5  # the newer file wins
    assert not rpc.passed and rpc.verdict == "MISS by 0.1"
    assert rpc.measured.source == "evidence/bench/b.json"
    batched = rows["bench.batched_4sessions_over_fifo"]
    assert batched.measured is None and batched.verdict == "MISS: no evidence"


def test_the_command_fails_unless_every_threshold_passes(repo_copy: RepoPaths) -> None:
    root = repo_copy.root  # the CLI validates prd.json against the story records: they stay, and
    for stale in (repo_copy.evidence / "bench").glob("*.json"):  # the bench files below are newer
        stale.unlink()
    prd = load_prd(repo_copy.prd)
    alpha = next(g for g in prd.gates if g.id.value == "alpha")
    passing: dict[str, dict[str, float]] = {}
    for t in alpha.thresholds:
        section, key = t.metric.split(".", 1)
        value = t.value if t.op == "==" else t.value + (0.5 if t.op == ">=" else -0.5)
        passing.setdefault(section, {})[key] = value
    write_bench(repo_copy, "all.json", "2031-01-01T00:00:00Z", passing)

    def gate() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["dgr-prd", "gate", "alpha"], cwd=root, capture_output=True, text=True, check=False
        )

    ok = gate()
    assert ok.returncode == 0, ok.stderr
    assert "| pass |" in ok.stdout and "MISS" not in ok.stdout
    section, key = alpha.thresholds[1].metric.split(".", 1)
    passing[section][key] = alpha.thresholds[1].value - 0.25
    write_bench(repo_copy, "all.json", "2031-01-02T00:00:00Z", passing)
    missed = gate()
    assert missed.returncode == 1
    assert f"{alpha.thresholds[1].metric}: MISS by 0.25" in missed.stderr


def test_a_row_measured_on_too_small_a_host_is_not_measurable_never_a_pass(
    repo_copy: RepoPaths,
) -> None:
    no_evidence(repo_copy)
    metric = {"bench": {"decode_ratio_3stage_vs_rpc": 2.0, "verify_ratio_vs_sha256sum": 5.0}}
    write_bench(repo_copy, "small.json", "2030-01-01T00:00:00Z", metric, {"cpu": {"cores": 2}})
    rows = {r.metric: r for r in evaluate(repo_copy, load_prd(repo_copy.prd), "alpha")}
    rpc = rows["bench.decode_ratio_3stage_vs_rpc"]
    assert rpc.compute_threads == 6
    assert not rpc.passed  # 2.0 would pass the threshold: the host cannot measure it
    assert rpc.verdict == (
        "not_measurable_here: needs 6 cores for 6 compute threads at once; the host had 2"
    )
    verify = rows["bench.verify_ratio_vs_sha256sum"]  # no condition: measured and gated anywhere
    assert verify.compute_threads is None and verify.passed
    write_bench(repo_copy, "nohost.json", "2030-01-02T00:00:00Z", metric, host=None)
    rows = {r.metric: r for r in evaluate(repo_copy, load_prd(repo_copy.prd), "alpha")}
    assert "does not record its host" in rows["bench.decode_ratio_3stage_vs_rpc"].verdict
    write_bench(repo_copy, "big.json", "2030-01-03T00:00:00Z", metric)
    rows = {r.metric: r for r in evaluate(repo_copy, load_prd(repo_copy.prd), "alpha")}
    big = rows["bench.decode_ratio_3stage_vs_rpc"]
    assert big.passed and big.measured is not None and big.measured.host is not None
    assert big.measured.host.cores == 16 and big.measured.commit == "ab" * 20


def test_the_review_prints_every_threshold_and_story_and_fails_unless_all_pass(
    repo_copy: RepoPaths,
) -> None:
    from dgr_prd.review import review

    prd = load_prd(repo_copy.prd)
    done = subprocess.run(
        ["dgr-prd", "gate-review", "alpha"],
        cwd=repo_copy.root,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1, done.stdout
    alpha = next(g for g in prd.gates if g.id.value == "alpha")
    for t in alpha.thresholds:
        assert f"| `{t.metric}` |" in done.stdout
    r = review(repo_copy, prd, "alpha")
    listed = {s.story for s in r.stories}
    assert "DGR-061" in listed and "DGR-071" not in listed  # the review does not review itself
    assert all(s.gate.value == "alpha" for s in prd.stories if s.id in listed)
    assert not r.passed
    unfinished = [s for s in r.stories if not s.passed]
    for s in unfinished:
        assert f"| {s.story} |" in done.stdout
