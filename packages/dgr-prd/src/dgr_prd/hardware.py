"""Hardware fingerprint: what a story's evidence ran on (CPU, GPU, OS, compiler, Python)."""

from __future__ import annotations

import hashlib
import json
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from dgr_records import cpu_info


def _run(cmd: list[str], timeout: float = 10.0) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    if meminfo.is_file():
        for line in meminfo.read_text(encoding="utf-8").splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return None


def gpus() -> list[dict[str, str]]:
    """NVIDIA GPUs through nvidia-smi; an empty list where there is none."""
    out = _run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    )
    found = []
    for line in (out or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            found.append(
                {"vendor": "nvidia", "name": parts[0], "driver": parts[1], "memory": parts[2]}
            )
    rocm = _run(["rocm-smi", "--showproductname", "--json"])
    if rocm:
        try:
            for card, info in json.loads(rocm).items():
                found.append(
                    {
                        "vendor": "amd",
                        "name": str(info.get("Card series", card)),
                        "driver": "rocm",
                        "memory": "",
                    }
                )
        except (ValueError, AttributeError):
            pass
    return found


def vulkan_devices() -> list[dict[str, str]]:
    """Vulkan devices as `vulkaninfo --summary` reports them (software ones such as Mesa's
    lavapipe included: a device type says which); an empty list without vulkaninfo or devices."""
    return parse_vulkan_summary(_run(["vulkaninfo", "--summary"], timeout=60.0) or "")


def parse_vulkan_summary(text: str) -> list[dict[str, str]]:
    """The `GPUn:` sections of `vulkaninfo --summary`: name, type, driver and API version."""
    keys = ("deviceName", "deviceType", "driverName", "driverInfo", "apiVersion")
    found: list[dict[str, str]] = []
    for line in text.splitlines():
        if re.match(r"^GPU\d+:$", line.strip()):
            found.append({})
            continue
        key, sep, value = line.strip().partition("=")
        if found and sep and key.strip() in keys:
            found[-1][key.strip()] = value.strip()
    return [d for d in found if "deviceName" in d]


def os_info(os_release: Path = Path("/etc/os-release")) -> dict[str, str]:
    info = {"system": platform.system(), "kernel": platform.release()}
    if os_release.is_file():
        for line in os_release.read_text(encoding="utf-8").splitlines():
            key, _, value = line.partition("=")
            if key == "PRETTY_NAME":
                info["distribution"] = value.strip().strip('"')
    return info


def compilers() -> dict[str, str | None]:
    def line(cmd: list[str], last: bool = False) -> str | None:
        lines = (_run(cmd) or "").splitlines()
        return (lines[-1] if last else lines[0]) if lines else None

    return {
        "cc": line(["cc", "--version"]),
        "cxx": line(["c++", "--version"]),
        "cmake": line(["cmake", "--version"]),
        "nvcc": line(["nvcc", "--version"], last=True),
    }


def fingerprint() -> dict[str, Any]:
    return {
        "hostname_sha256": hashlib.sha256(platform.node().encode()).hexdigest()[:12],
        "cpu": cpu_info(),
        "memory_bytes": memory_bytes(),
        "gpus": gpus(),
        "vulkan_devices": vulkan_devices(),
        "os": os_info(),
        "compilers": compilers(),
        "python": sys.version.split()[0],
    }
