"""pytest plugin: under a story run, report test counts as evidence metrics."""

from __future__ import annotations

import os

import pytest
from dgr_records import report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not os.environ.get("DGR_METRICS"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = getattr(reporter, "stats", {}) if reporter else {}
    counts = {k: len(stats.get(k, [])) for k in ("passed", "failed", "skipped", "error")}
    report(
        "pytest", {**{f"tests_{k}": v for k, v in counts.items()}, "exit_status": int(exitstatus)}
    )
