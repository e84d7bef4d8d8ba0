"""Certification records (DGR-054): what a certification run proved, bound to the exact descriptor
of the build it ran and to the hardware it ran on, sealed by a sha256 over everything else in it.

A tracker advertises a worker's lane only when a record for that very descriptor and hardware
passed and its seal holds: a lane nobody certified (CUDA on this machine) is never advertised,
and a record edited after sealing counts for nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from pydantic import Field, ValidationError

from dgr_meshnet.inputs import HEX40, HEX64, CompatibilityDescriptor, Lane, _Input


class TamperedRecord(ValueError):
    """A record whose seal does not match its content, or a file that is not a record."""


class CertificationRecord(_Input):
    descriptor: CompatibilityDescriptor
    hardware_sha256: str = Field(pattern=HEX64, description="sha256 of the hardware fingerprint")
    lane: Lane
    model: str = Field(min_length=1, max_length=128)
    layouts: int = Field(ge=1, description="layouts the parity harness ran")
    max_abs_logit_diff: float = Field(ge=0, description="largest difference from one process")
    passed: bool
    device: str = Field(
        default="",
        max_length=200,
        description="the device the lane ran on, as its driver reports it (empty: the CPU)",
    )
    commit: str = Field(pattern=HEX40, description="the clean commit the run was made from")
    created_utc: str = Field(
        min_length=20, max_length=20, pattern=r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$"
    )
    record_sha256: str = Field(
        pattern=HEX64, description="sha256 of the canonical JSON of the rest"
    )


def hardware_sha256(fingerprint: dict[str, object]) -> str:
    """The hardware a record is bound to: sha256 of the fingerprint's canonical JSON."""
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()


def _content_sha256(record: CertificationRecord) -> str:
    # a record without a device (the CPU's, and every record before the field) seals as before
    exclude = {"record_sha256"} | ({"device"} if not record.device else set())
    content = record.model_dump(mode="json", exclude=exclude)
    return hashlib.sha256(
        json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def seal(**fields: object) -> CertificationRecord:
    """A record of `fields`, its seal computed over them."""
    draft = CertificationRecord.model_validate({**fields, "record_sha256": "0" * 64})
    return draft.model_copy(update={"record_sha256": _content_sha256(draft)})


def verify(record: CertificationRecord) -> None:
    if _content_sha256(record) != record.record_sha256:
        raise TamperedRecord(
            f"certification record for {record.model} on {record.lane}: its content does not match"
            f" record_sha256 {record.record_sha256[:12]}… (edited after it was sealed)"
        )


def read_record(path: Path) -> CertificationRecord:
    """A record from a file, validated and its seal checked; TamperedRecord names the file."""
    try:
        record = CertificationRecord.model_validate_json(path.read_bytes())
        verify(record)
    except (ValidationError, TamperedRecord) as exc:
        raise TamperedRecord(f"{path}: {exc}") from exc
    return record


def write_record(directory: Path, record: CertificationRecord) -> Path:
    verify(record)
    directory.mkdir(parents=True, exist_ok=True)
    path = (
        directory / f"{record.lane}-{record.model}-{record.descriptor.model_fingerprint[:12]}.json"
    )
    path.write_text(record.model_dump_json(indent=2) + "\n", encoding="utf-8")
    return path


def advertised_lanes(
    descriptor: CompatibilityDescriptor, hardware: str, records: Iterable[CertificationRecord]
) -> list[str]:
    """The lanes a worker with `descriptor` on `hardware` may advertise: exactly those holding a
    passing, intact record for that descriptor (build, model, recipe) and that hardware."""
    lanes = set()
    for record in records:
        verify(record)
        if (
            record.passed
            and record.hardware_sha256 == hardware
            and record.descriptor == descriptor
            and record.lane == descriptor.lane
        ):
            lanes.add(record.lane)
    return sorted(lanes)
