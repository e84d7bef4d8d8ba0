"""The evidence site's lane table: one row per lane, the probe's device and verdict where a probe
ran, and only passing certification records counted as certified."""

from __future__ import annotations

import json
import shutil

import pytest
from dgr_prd.model import Lane
from dgr_prd.paths import RepoPaths
from dgr_prd.site import render_lanes
from dgr_records import write_bench


def test_every_lane_has_one_row(repo: RepoPaths) -> None:
    rows = [line for line in render_lanes(repo) if line.startswith("| ") and "---" not in line]
    assert [r.split("|")[1].strip() for r in rows[1:]] == [lane.value for lane in Lane]


def test_a_probe_and_a_failed_record_show_as_what_they_are(repo_copy: RepoPaths) -> None:
    bench = repo_copy.evidence / "bench"
    bench.mkdir(parents=True, exist_ok=True)
    (bench / "lane-vulkan.json").write_text(
        json.dumps(
            {
                "device": "llvmpipe (test)",
                "measured_utc": "2026-12-02T00:00:00Z",
                "rows": [{"nmse_max": 7.7e-4, "greedy_identical": False, "meets_bar": False}],
            }
        )
    )
    shutil.rmtree(repo_copy.root / "certification" / "vulkan", ignore_errors=True)
    failed = repo_copy.root / "certification" / "vulkan" / "vulkan-x.json"
    failed.parent.mkdir(parents=True)
    failed.write_text(json.dumps({"model": "m", "passed": False}))
    [row] = [line for line in render_lanes(repo_copy) if line.startswith("| vulkan |")]
    assert "llvmpipe (test)" in row and "7.7e-04, diverges (misses the bar" in row
    assert row.rstrip().endswith("| none |")  # a failed record certifies nothing


def test_a_bench_result_lands_where_the_site_and_the_gates_read_it(
    repo_copy: RepoPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DGR_REPO_ROOT", str(repo_copy.root))
    path = write_bench(
        "lane-vulkan",
        {
            "device": "d",
            "measured_utc": "t",
            "rows": [{"nmse_max": 1e-5, "greedy_identical": True, "meets_bar": True}],
        },
    )
    assert path == repo_copy.evidence / "bench" / "lane-vulkan.json"
    [row] = [line for line in render_lanes(repo_copy) if line.startswith("| vulkan |")]
    assert "| d | 1.0e-05, identical (meets the bar, t) |" in row
