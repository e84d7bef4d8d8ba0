"""A short soak (DGR-064's `nox -s soak` runs 10 minutes): load through the coordinator and the
OpenAI server for 40 s, nothing fails, no session is left, file descriptors and threads do
not trend up, and worker RSS stays flat after the warm-up (within 5% over so short a run; the
full soak holds it to 2%)."""

from __future__ import annotations

import pytest
from dgr_cert import soak

# a soak of a route of real workers
pytestmark = pytest.mark.fleet


def test_a_short_soak_fails_nothing_and_leaks_nothing() -> None:
    result = soak.run(seconds=40, warmup_s=15, sessions=2, http=1, seed=7)
    assert result["errors"] == 0, result["error_examples"]
    assert result["requests"] > 10 and result["tokens_generated"] > 100
    assert result["sessions_left"] == [0, 0, 0]
    leaks = [p for p in result["problems"] if "RSS" not in p]
    assert not leaks, leaks
    for name, p in result["processes"].items():
        if name.startswith("worker"):
            assert p["rss_growth"] < 0.05, (name, p)
