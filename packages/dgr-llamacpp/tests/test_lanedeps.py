"""A lane's needs beyond the pinned tree (native/llama.cpp/lane-deps.json): the CPU lane has none;
the Vulkan lane names the Debian packages it needs when a tool is missing, and pins the newer
Vulkan headers it takes from a registry by URL and sha256; the CUDA lane pins its toolkit's
wheels, unpacked into one tree with nvcc executable and the .so links FindCUDAToolkit needs."""

from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path

import pytest
from dgr_llamacpp import lanedeps
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


def test_the_cuda_toolkit_wheels_are_pinned() -> None:
    spec = manifest(find_root().root)["cuda"]
    names = {w["name"] for w in spec["wheels"]}
    assert {"nvidia-cuda-nvcc", "nvidia-cuda-runtime", "nvidia-cublas"} <= names
    for w in spec["wheels"]:
        assert re.fullmatch(r"[0-9a-f]{64}", w["sha256"]), w["name"]
    assert "-DGGML_CUDA_NO_VMM=ON" in spec["cmake"]  # no wheel ships the driver's libcuda
    assert "-DCMAKE_CUDA_ARCHITECTURES=90" in spec["cmake"]


def fake_wheel(path: Path, files: dict[str, tuple[bytes, int]]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, (data, mode) in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o100000 | mode) << 16
            z.writestr(info, data)
    return path


def test_wheels_unpack_into_one_tree_with_their_modes_and_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DGR_CACHE", str(tmp_path / "cache"))
    wheels = {
        "nvcc": fake_wheel(
            tmp_path / "a.whl",
            {
                "nvidia/cu13/bin/nvcc": (b"#!/bin/sh\n", 0o755),
                "nvidia_cuda_nvcc-1.dist-info/METADATA": (b"x", 0o644),
            },
        ),
        "rt": fake_wheel(tmp_path / "b.whl", {"nvidia/cu13/lib/libcudart.so.13": (b"elf", 0o644)}),
    }
    monkeypatch.setattr(
        lanedeps, "fetch_wheel", lambda name, version, file, sha256, into: wheels[name]
    )
    pins = [{"name": n, "version": "1", "file": "x.whl", "sha256": n * 8} for n in wheels]
    root = lanedeps.unpack_wheels(pins, "nvidia/cu13", {"lib/libcudart.so": "libcudart.so.13"})
    assert os.access(root / "bin" / "nvcc", os.X_OK)
    assert not (root / "lib" / "libcudart.so.13").stat().st_mode & 0o111
    assert (root / "lib" / "libcudart.so").resolve() == (root / "lib" / "libcudart.so.13").resolve()
    assert not list(root.parent.parent.glob("*.dist-info"))
    # once unpacked, nothing is fetched again
    monkeypatch.setattr(lanedeps, "fetch_wheel", lambda *a: pytest.fail("fetched twice"))
    assert lanedeps.unpack_wheels(pins, "nvidia/cu13", {}) == root


def test_a_link_to_a_file_no_wheel_has_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DGR_CACHE", str(tmp_path / "cache"))
    wheel = fake_wheel(tmp_path / "a.whl", {"nvidia/cu13/lib/libcudart.so.13": (b"elf", 0o644)})
    monkeypatch.setattr(lanedeps, "fetch_wheel", lambda *a: wheel)
    pins = [{"name": "rt", "version": "1", "file": "x.whl", "sha256": "0" * 64}]
    with pytest.raises(LaneDepsError, match=r"libcublas\.so\.13 is not in the unpacked wheels"):
        lanedeps.unpack_wheels(pins, "nvidia/cu13", {"lib/libcublas.so": "libcublas.so.13"})
