"""docs/perf.md, the performance log: generated from the bench log that write_bench appends to,
kept current as a projection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dgr_prd.paths import RepoPaths, find_root
from dgr_prd.perf import read_history, render_perf
from dgr_records import HISTORY, write_bench


def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RepoPaths:
    (tmp_path / "prd.json").write_text("{}")
    monkeypatch.setenv("DGR_REPO_ROOT", str(tmp_path))
    return RepoPaths(tmp_path)


def test_each_bench_run_written_into_the_checkout_is_logged_and_shown_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = repo(tmp_path, monkeypatch)
    for when, ratio in (("2026-12-01T00:00:00Z", 0.9), ("2026-12-02T00:00:00Z", 1.1)):
        write_bench("bench-x", {"measured_utc": when, "gate_metrics": {"x": {"ratio": ratio}}})
    write_bench("bench-y", {"measured_utc": "2026-12-01T12:00:00Z", "mib_s": 512, "ok": True})
    write_bench("elsewhere", {"n": 1}, out=tmp_path / "other.json")  # not the checkout's: no log
    runs = read_history(paths.evidence / "bench" / HISTORY)
    assert [(r["bench"], r["metrics"]) for r in runs] == [
        ("bench-x", {"ratio": 0.9}),
        ("bench-y", {"mib_s": 512.0}),  # a flag is no measurement
        ("bench-x", {"ratio": 1.1}),
    ]
    assert all(r["cores"] >= 1 for r in runs)
    page = render_perf(paths)
    assert "## bench-x\n\n2 run(s); latest 2026-12-02T00:00:00Z" in page
    assert "| `ratio` | 1.1 | 0.9 |" in page and "| `mib_s` | 512 | - |" in page
    assert "elsewhere" not in page


def test_a_run_logged_twice_counts_once_and_a_bad_line_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = repo(tmp_path, monkeypatch)
    for _ in range(2):
        write_bench("bench-x", {"measured_utc": "2026-12-01T00:00:00Z", "v": 2})
    log = paths.evidence / "bench" / HISTORY
    assert len(log.read_text().splitlines()) == 2 and len(read_history(log)) == 1
    log.write_text(log.read_text() + json.dumps({"bench": "b"}) + "\n")
    with pytest.raises(ValueError, match=r"history.jsonl:3: not a bench run"):
        read_history(log)


def test_the_committed_perf_page_is_the_committed_logs() -> None:
    # the projection check (`dgr-prd project --check`) holds this too: a bench run committed
    # without `nox -s prd` leaves docs/perf.md stale
    paths = find_root(Path(__file__).parent)
    assert (paths.docs / "perf.md").read_text(encoding="utf-8") == render_perf(paths)
    assert read_history(paths.evidence / "bench" / HISTORY), "the log holds the committed runs"
