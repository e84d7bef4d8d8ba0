"""A lane's needs beyond the pinned tree (native/llama.cpp/lane-deps.json): the CPU lane has none;
the Vulkan lane names the Debian packages it needs when a tool is missing, and pins the newer
Vulkan headers it takes from a registry by URL and sha256."""

from __future__ import annotations

import re

import pytest
from dgr_llamacpp.lanedeps import LaneDepsError, lane_cmake_args, manifest
from dgr_prd.paths import find_root


def test_the_cpu_lanes_need_nothing_more() -> None:
    root = find_root().root
    assert lane_cmake_args(root, "cpu") == []
    assert lane_cmake_args(root, "cpu-rpc") == []


def test_a_missing_tool_names_the_packages_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no glslc anywhere: what a bare machine has
    with pytest.raises(LaneDepsError, match=r"vulkan lane needs glslc: apt-get install .*glslc"):
        lane_cmake_args(find_root().root, "vulkan")


def test_the_vulkan_headers_are_pinned() -> None:
    deb = manifest(find_root().root)["vulkan"]["deb"]
    assert isinstance(deb, dict)
    assert re.fullmatch(r"[0-9a-f]{64}", str(deb["sha256"]))
    assert str(deb["url"]).startswith("http://deb.debian.org/debian/pool/main/v/vulkan-loader/")
