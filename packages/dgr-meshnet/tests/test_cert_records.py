"""DGR-054: certification records are sealed, bound to a descriptor and a hardware fingerprint; a
tampered record fails its check and an uncertified lane is never advertised. The descriptor is a
live worker's; the parity figures are the test's own (the records certify nothing here, they
exercise the seal and the advertising rule)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from dgr_cli.workers import WorkerProcess
from dgr_meshnet.certification import (
    CertificationRecord,
    TamperedRecord,
    advertised_lanes,
    hardware_sha256,
    read_record,
    seal,
    verify,
    write_record,
)
from dgr_meshnet.collect import descriptor
from dgr_meshnet.inputs import CompatibilityDescriptor
from dgr_prd.hardware import fingerprint


@pytest.fixture(scope="module")
def here() -> str:
    return hardware_sha256(fingerprint())


@pytest.fixture
def live(metered_workers: list[WorkerProcess]) -> CompatibilityDescriptor:
    return descriptor(metered_workers[0].address)


def record(d: CompatibilityDescriptor, hardware: str, **change: object) -> CertificationRecord:
    fields: dict[str, object] = {
        "descriptor": d,
        "hardware_sha256": hardware,
        "lane": d.lane,
        "model": "smollm2-135m-q4_1",
        "layouts": 12,
        "max_abs_logit_diff": 0.0,
        "passed": True,
        "commit": "a" * 40,
        "created_utc": "2026-12-02T01:00:00Z",
        **change,
    }
    return seal(**fields)


def test_a_sealed_record_verifies_and_any_edit_breaks_it(
    live: CompatibilityDescriptor, here: str
) -> None:
    good = record(live, here)
    verify(good)
    edits: dict[str, object] = {
        "passed": False,
        "max_abs_logit_diff": 1e-3,
        "layouts": 13,
        "lane": "cuda",
        "hardware_sha256": "f" * 64,
        "descriptor": live.model_copy(update={"patch_stack_sha256": "e" * 64}),
        "created_utc": "2026-12-03T01:00:00Z",
        "device": "llvmpipe (LLVM 15.0.6, 256 bits)",
    }
    for field, value in edits.items():
        edited = good.model_copy(update={field: value})
        with pytest.raises(TamperedRecord, match="edited after it was sealed"):
            verify(edited)


def test_a_device_is_sealed_and_a_record_without_one_seals_as_before(
    live: CompatibilityDescriptor, here: str
) -> None:
    on_device = record(live, here, lane="vulkan", device="llvmpipe (LLVM 15.0.6, 256 bits)")
    verify(on_device)
    with pytest.raises(TamperedRecord, match="edited after it was sealed"):
        verify(on_device.model_copy(update={"device": "NVIDIA H200"}))
    # records sealed before the field existed (the CPU's on disk) keep their seal
    cpu = record(live, here)
    content = cpu.model_dump(mode="json", exclude={"record_sha256", "device"})
    old_seal = json.dumps(content, sort_keys=True, separators=(",", ":"))
    assert cpu.record_sha256 == hashlib.sha256(old_seal.encode()).hexdigest()


def test_records_on_disk(live: CompatibilityDescriptor, here: str, tmp_path: Path) -> None:
    path = write_record(tmp_path, record(live, here))
    assert read_record(path) == record(live, here)
    data = json.loads(path.read_text())
    data["max_abs_logit_diff"] = 0.5  # a worse parity figure, edited in the file
    path.write_text(json.dumps(data))
    with pytest.raises(TamperedRecord, match=path.name):
        read_record(path)
    path.write_text("{not json")
    with pytest.raises(TamperedRecord, match=path.name):
        read_record(path)


def test_only_certified_lanes_are_advertised(live: CompatibilityDescriptor, here: str) -> None:
    assert advertised_lanes(live, here, []) == []
    assert advertised_lanes(live, here, [record(live, here)]) == ["cpu"]
    # nothing else counts: a failed run, other hardware, another build, another model's worker
    assert advertised_lanes(live, here, [record(live, here, passed=False)]) == []
    assert advertised_lanes(live, here, [record(live, "f" * 64)]) == []
    other_build = live.model_copy(update={"llama_cpp_commit": "b" * 40})
    assert advertised_lanes(other_build, here, [record(live, here)]) == []
    # a CUDA build of the same model with no record of its own is never advertised, even beside
    # a passing CPU record, nor by a record whose lane disagrees with its descriptor
    cuda = live.model_copy(update={"lane": "cuda"})
    assert advertised_lanes(cuda, here, [record(live, here)]) == []
    assert advertised_lanes(cuda, here, [record(cuda, here, lane="cpu")]) == []
    with pytest.raises(TamperedRecord):
        advertised_lanes(
            live, here, [record(live, here).model_copy(update={"passed": True, "layouts": 1})]
        )
