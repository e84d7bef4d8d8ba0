"""Hardware lanes: which backends this machine can run evidence on.

A lane is available only when the hardware and its runtime are really present; the story runner
records a command whose lane is missing as skipped, never as passed.
"""

from __future__ import annotations

import platform
from typing import Any

from dgr_prd.model import Lane


def available_lanes(hardware: dict[str, Any]) -> list[Lane]:
    lanes = [Lane.CPU]
    vendors = {g.get("vendor") for g in hardware.get("gpus", [])}
    if "nvidia" in vendors:
        lanes.append(Lane.CUDA)
    if "amd" in vendors:
        lanes.append(Lane.ROCM)
    if hardware.get("vulkan_devices"):  # a device vulkaninfo lists (lavapipe counts: it is one)
        lanes.append(Lane.VULKAN)
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        lanes.append(Lane.METAL)
    return lanes


# lanes no test or CI run builds here, and why (the registry, `dgr-native lanes`, and the site)
NOT_BUILT = {
    Lane.CUDA: "built on demand (`nox -s native-build -- --lane cuda`: sm_90, the toolkit from "
    "PyPI's NVIDIA wheels, about 25 minutes on 2 cores); certified only on a machine with an "
    "NVIDIA GPU (`nox -s certify -- --lane cuda`, which names what that machine lacks)",
    Lane.ROCM: "planned: no ROCm toolchain (hipcc) in Debian 12's or PyPI's packages, no AMD GPU",
    Lane.METAL: "planned: Metal exists on Apple silicon under macOS only",
}


def missing_lane_reason(lane: Lane) -> str:
    return {
        Lane.CPU: "no CPU lane (cannot happen)",
        Lane.CUDA: "no NVIDIA GPU visible through nvidia-smi on this machine",
        Lane.ROCM: "no AMD GPU visible through rocm-smi on this machine",
        Lane.VULKAN: "no Vulkan device listed by vulkaninfo on this machine",
        Lane.METAL: "not an Apple Silicon macOS machine",
    }[lane]
