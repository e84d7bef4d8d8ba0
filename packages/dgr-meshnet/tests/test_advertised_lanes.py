"""DGR-021: the lanes a worker advertises are exactly the lanes holding a passing certification
record for its descriptor and this machine: a real certification run (layout parity in process
and over workers, one layout family) makes "cpu" advertisable here; CUDA, never certified, is not.
The records committed under certification/ (by `nox -s certify`) must be intact."""

from __future__ import annotations

from pathlib import Path

from dgr_cert.certify import certify_model
from dgr_cli.workers import WorkerProcess
from dgr_meshnet.certification import advertised_lanes, hardware_sha256, read_record, write_record
from dgr_meshnet.collect import descriptor
from dgr_prd.hardware import fingerprint
from dgr_prd.paths import find_root
from dgr_prd.runner import git_state


def test_certified_lanes_are_advertised_and_no_other(
    smollm2: Path, metered_workers: list[WorkerProcess], tmp_path: Path
) -> None:
    commit = git_state(find_root().root).commit
    assert commit is not None
    record = certify_model(
        "cpu", "smollm2-135m-q4_1", smollm2, commit, stages=[2], prompt_tokens=32, decode=4
    )
    assert record.passed and record.layouts >= 1 and record.max_abs_logit_diff == 0.0
    records = [read_record(write_record(tmp_path, record))]
    here = hardware_sha256(fingerprint())
    live = descriptor(metered_workers[0].address)
    assert advertised_lanes(live, here, records) == ["cpu"]
    assert advertised_lanes(live.model_copy(update={"lane": "cuda"}), here, records) == []
    assert advertised_lanes(live, here, []) == []  # no record: nothing advertised


def test_committed_records_are_intact() -> None:
    committed = sorted((find_root().root / "certification").rglob("*.json"))
    for path in committed:
        record = read_record(path)  # raises, naming the file, on any edit
        assert record.lane == path.parent.name and record.passed
