"""Hardware fingerprint and lane registry."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dgr_prd.hardware import fingerprint, memory_bytes, os_info, parse_vulkan_summary
from dgr_prd.lanes import available_lanes, missing_lane_reason
from dgr_prd.model import Lane


def test_fingerprint_of_this_machine() -> None:
    hw = fingerprint()
    assert hw["cpu"]["cores"] >= 1 and hw["cpu"]["model"]
    assert isinstance(hw["memory_bytes"], int) and hw["memory_bytes"] > 2**28
    assert hw["os"]["system"] == "Linux"
    assert hw["python"].count(".") == 2
    assert isinstance(hw["gpus"], list)
    assert set(hw["compilers"]) == {"cc", "cxx", "cmake", "nvcc"}


def test_meminfo_and_os_release(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text("MemTotal:       24576000 kB\nMemFree: 1 kB\n")
    assert memory_bytes(tmp_path / "meminfo") == 24576000 * 1024
    (tmp_path / "os-release").write_text('PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\n')
    assert os_info(tmp_path / "os-release")["distribution"] == "Debian GNU/Linux 12 (bookworm)"


def test_lanes_follow_the_hardware() -> None:
    cpu_only: dict[str, Any] = {"gpus": []}
    assert available_lanes(cpu_only) == [Lane.CPU]
    nvidia = {"gpus": [{"vendor": "nvidia", "name": "H200", "driver": "580", "memory": ""}]}
    assert Lane.CUDA in available_lanes(nvidia)
    assert Lane.ROCM not in available_lanes(nvidia)
    assert "nvidia-smi" in missing_lane_reason(Lane.CUDA)
    # a Vulkan device is what vulkaninfo lists, a software one (lavapipe) included
    lavapipe = {"gpus": [], "vulkan_devices": [{"deviceName": "llvmpipe (LLVM 15.0.6, 256 bits)"}]}
    assert available_lanes(lavapipe) == [Lane.CPU, Lane.VULKAN]
    assert Lane.VULKAN not in available_lanes({"gpus": [], "vulkan_devices": []})


def test_vulkan_summary_sections() -> None:
    text = """Devices:
========
GPU0:
\tapiVersion         = 1.3.230
\tdeviceType         = PHYSICAL_DEVICE_TYPE_CPU
\tdeviceName         = llvmpipe (LLVM 15.0.6, 256 bits)
\tdriverName         = llvmpipe
\tdriverInfo         = Mesa 22.3.6 (LLVM 15.0.6)
GPU1:
\tdeviceType         = PHYSICAL_DEVICE_TYPE_DISCRETE_GPU
\tdeviceName         = NVIDIA H200
"""
    assert parse_vulkan_summary(text) == [
        {
            "apiVersion": "1.3.230",
            "deviceType": "PHYSICAL_DEVICE_TYPE_CPU",
            "deviceName": "llvmpipe (LLVM 15.0.6, 256 bits)",
            "driverName": "llvmpipe",
            "driverInfo": "Mesa 22.3.6 (LLVM 15.0.6)",
        },
        {"deviceType": "PHYSICAL_DEVICE_TYPE_DISCRETE_GPU", "deviceName": "NVIDIA H200"},
    ]
    assert parse_vulkan_summary("") == []
