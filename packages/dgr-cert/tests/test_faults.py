"""Fault injection (DGR-063), one fault of every kind on real routes with concurrent sessions:
each gives its typed error naming the stage within the deadline (or, a delay spike, none), the
untouched route's session never sees an error, and every session finishes with the output of
its uninterrupted run. `nox -s chaos` runs the same cycle over 200+ seeded faults."""

from __future__ import annotations

import pytest
from dgr_cert import chaos

# every test here injects faults into a route of real workers
pytestmark = pytest.mark.fleet


def test_every_fault_kind_is_named_in_time_and_loses_nothing() -> None:
    summary, outcomes = chaos.run(seed=20261201, n_faults=len(chaos.KINDS))
    problems = {f"{o.index} {o.kind} (stage {o.stage})": o.problems for o in outcomes if o.problems}
    assert not problems, problems
    assert summary["faults_by_kind"] == {kind: 1 for kind in chaos.KINDS}
    assert summary["faults_detected"] == summary["faults_expecting_an_error"]
    assert summary["sessions_hung"] == 0 and summary["sessions_lost"] == 0
    assert summary["sessions_identical"] == summary["sessions"]
    assert summary["untouched_route_errors"] == 0
    assert summary["detect_p99_s"] is not None and summary["detect_p99_s"] <= chaos.DEADLINE_S


def test_a_schedule_is_reproducible_from_its_seed() -> None:
    assert chaos.schedule(7, 30) == chaos.schedule(7, 30)
    assert chaos.schedule(7, 30) != chaos.schedule(8, 30)
    assert {f.kind for f in chaos.schedule(7, 30)} == set(chaos.KINDS)
