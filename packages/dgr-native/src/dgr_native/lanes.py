"""`dgr-native lanes`: the lane registry. For each compile lane: its build (whether this checkout
has one, and the CMake flags it takes), its run status (the device this machine shows for it, as
its driver names it) and its certification (the intact, passing records in certification/<lane>/,
with the device each ran on). A worker advertises a lane only with such a record for its exact
descriptor and hardware (dgr_meshnet.certification); `dgr worker --lane L` refuses a lane with no
build."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from dgr_llamacpp.build import LANE_OPTIONS
from dgr_meshnet.certification import TamperedRecord, hardware_sha256, read_record
from dgr_prd.hardware import fingerprint
from dgr_prd.lanes import NOT_BUILT
from dgr_prd.model import Lane
from dgr_prd.paths import find_root

from dgr_native.build import is_built


@dataclass
class LaneStatus:
    lane: str
    flags: list[str]
    built: bool
    devices: list[str]  # what this machine shows for the lane, as its drivers name it
    certified: list[str] = field(default_factory=list)  # "model on device" of passing records
    note: str = ""


def devices(lane: Lane, hardware: dict[str, Any]) -> list[str]:
    """The devices of `hardware` (dgr_prd.hardware.fingerprint) that `lane` computes on."""
    if lane == Lane.CPU:
        return [str(hardware.get("cpu", {}).get("model", "cpu"))]
    if lane == Lane.VULKAN:
        return [str(d["deviceName"]) for d in hardware.get("vulkan_devices", [])]
    vendor = {Lane.CUDA: "nvidia", Lane.ROCM: "amd"}.get(lane)
    return [str(g["name"]) for g in hardware.get("gpus", []) if g.get("vendor") == vendor]


def registry() -> list[LaneStatus]:
    root = find_root().root
    hardware = fingerprint()
    here = hardware_sha256(hardware)
    out = []
    for lane in Lane:
        certified = []
        for path in sorted((root / "certification" / lane.value).glob("*.json")):
            try:
                record = read_record(path)
            except TamperedRecord as exc:
                certified.append(f"TAMPERED: {exc}")
                continue
            if record.passed:
                where = "this machine" if record.hardware_sha256 == here else "other hardware"
                certified.append(f"{record.model} on {record.device or 'cpu'} ({where})")
        out.append(
            LaneStatus(
                lane=lane.value,
                flags=list(LANE_OPTIONS.get(lane.value, [])),
                built=is_built(lane.value),
                devices=devices(lane, hardware),
                certified=certified,
                note=NOT_BUILT.get(lane, ""),
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dgr-native lanes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    lanes = registry()
    if args.json:
        print(json.dumps([asdict(s) for s in lanes], indent=2))
        return 0
    for s in lanes:
        print(
            f"{s.lane:7} build: {'built' if s.built else 'not built'} ({' '.join(s.flags)}); "
            f"device: {', '.join(s.devices) or 'none'}; "
            f"certified: {'; '.join(s.certified) or 'none'}"
        )
        if s.note:
            print(f"        {s.note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
