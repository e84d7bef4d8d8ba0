"""dgr_records: what the benches, the planner and the story runner write, as they call it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from dgr_records import checkout, cpu_info, git_state, report, write_bench


def test_report_merges_sections_into_the_runs_metrics_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DGR_METRICS", raising=False)
    assert report("bench", {"x": 1}) is None  # outside a story run: nothing written
    target = tmp_path / "metrics.json"
    monkeypatch.setenv("DGR_METRICS", str(target))
    report("bench", {"x": 1, "y": 2})
    report("bench", {"y": 3})
    report("serve", {"z": 0.5})
    assert json.loads(target.read_text()) == {"bench": {"x": 1, "y": 3}, "serve": {"z": 0.5}}


def test_a_bench_outside_a_checkout_needs_a_file_and_records_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DGR_REPO_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)
    assert checkout() is None
    with pytest.raises(FileNotFoundError, match=r"evidence/bench/route\.json"):
        write_bench("route", {"rows": {}})
    out = write_bench("route", {"rows": {"a": 1.0}}, out=tmp_path / "sub" / "r.json")
    data = json.loads(out.read_text())
    assert data["rows"] == {"a": 1.0} and data["host"]["cpu"]["cores"] >= 1
    assert "git" not in data  # no checkout: no commit to name


def test_a_bench_in_a_checkout_names_its_commit_and_whether_the_tree_was_dirty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True)
        return done.stdout.strip()

    monkeypatch.delenv("DGR_REPO_ROOT", raising=False)
    git("init", "-q")
    (tmp_path / "prd.json").write_text("{}")
    git("add", "prd.json")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    (tmp_path / "deep").mkdir()
    monkeypatch.chdir(tmp_path / "deep")
    assert checkout() == tmp_path.resolve()
    assert git_state(tmp_path) == {"commit": git("rev-parse", "HEAD"), "dirty": False}
    path = write_bench("route", {"rows": {}})
    assert path == tmp_path.resolve() / "evidence" / "bench" / "route.json"
    data = json.loads(path.read_text())
    assert data["git"] == {"commit": git("rev-parse", "HEAD"), "dirty": False}
    # the record it wrote is not committed: the next one says the tree was dirty
    assert json.loads(write_bench("again", {}).read_text())["git"]["dirty"] is True
    assert git_state(Path("/"))["commit"] is None  # no work tree there


def test_cpu_flags_name_amx(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: Example Xeon\nflags\t\t: fpu sse4_2 avx2 avx512f "
        "amx_tile amx_int8 amx_bf16\n\nprocessor\t: 1\nmodel name\t: Example Xeon\n"
    )
    info = cpu_info(cpuinfo)
    assert info["model"] == "Example Xeon"
    assert info["notable_flags"] == [
        "sse4_2",
        "avx2",
        "avx512f",
        "amx_tile",
        "amx_int8",
        "amx_bf16",
    ]
