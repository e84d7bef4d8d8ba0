"""The CUDA certification's preflight names what a GPU machine lacks before anything runs. No
machine of this project has an NVIDIA GPU: the driver's tool is stood in for by a script that
prints what nvidia-smi prints, so each refusal is reached through the code `certify` runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from dgr_cert.certify import main as certify
from dgr_cert.lane_probe import PreflightError, preflight_cuda


def fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nprintf '{rows}'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def test_no_driver_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(PreflightError, match="nvidia-smi not found"):
        preflight_cuda()


@pytest.mark.parametrize(
    ("rows", "refusal"),
    [
        # a GPU the build has no kernels for
        ("NVIDIA A100-SXM4-80GB, 580.65, 8.0\\n", r"built for compute capability 9\.0.*A100.*8\.0"),
        # the right GPU, but no driver library to load (this machine has none)
        ("NVIDIA H200, 580.65, 9.0\\n", r"libcuda\.so\.1 does not load"),
    ],
)
def test_what_the_gpu_machine_lacks_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: str, refusal: str
) -> None:
    fake_smi(tmp_path, monkeypatch, rows)
    with pytest.raises(PreflightError, match=refusal):
        preflight_cuda()


def test_certify_stops_at_the_preflight_with_its_reason(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert certify(["--lane", "cuda"]) == 2
    assert "cuda preflight failed: nvidia-smi not found" in capsys.readouterr().out
