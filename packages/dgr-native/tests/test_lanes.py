"""Issue 16's lane registry: per lane its build, the device this machine shows for it and its
certification records; a lane with no build is refused by `dgr worker --lane` and by the engine
locator, by name, and a device lane's build with no device refuses to offload rather than run on
the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from dgr_native.build import is_built
from dgr_native.lanes import registry
from dgr_prd.lanes import NOT_BUILT
from dgr_route.engine import ENV, EngineNotFound, locate


def test_registry_lists_every_lane_with_build_device_and_records() -> None:
    lanes = {s.lane: s for s in registry()}
    assert list(lanes) == ["cpu", "cuda", "rocm", "vulkan", "metal"]
    assert lanes["cpu"].built and lanes["cpu"].devices  # the tests run on it
    assert "-DGGML_VULKAN=ON" in lanes["vulkan"].flags
    for lane in ("rocm", "metal"):
        assert not lanes[lane].built and lanes[lane].note == NOT_BUILT[lane]
    # the committed record: the f32 twin, certified on lavapipe (mixed layouts included)
    assert any(c.startswith("qwen2-twin on llvmpipe") for c in lanes["vulkan"].certified)
    assert any(c.startswith("smollm2-135m-q4_1 on cpu") for c in lanes["cpu"].certified)


def test_a_lane_without_a_build_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(EngineNotFound, match=r"no rocm build in this checkout: `dgr-native build"):
        locate("rocm")
    dgr = str(Path(sys.executable).parent / "dgr")
    env = {k: v for k, v in os.environ.items() if k != ENV}
    done = subprocess.run(
        [dgr, "worker", "--lane", "metal", "--layers", "0:15"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 2 and "no metal build in this checkout" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(not is_built("cuda"), reason="no CUDA build in this checkout's cache")
def test_a_device_lane_without_its_device_is_refused_not_run_on_the_cpu(smollm2: Path) -> None:
    """A CUDA build on a machine without a GPU (this one) must not compute on the CPU while
    reporting the cuda lane: its worker refuses, naming the lane and what is missing."""
    from dgr_cli.workers import start_worker

    with pytest.raises(RuntimeError, match=r"the cuda build sees no device on this machine"):
        start_worker(smollm2, 0, 30, n_ctx=64, lane="cuda", timeout=60)
    worker = start_worker(smollm2, 0, 30, n_ctx=64, lane="cuda", extra=["--gpu-layers", "0"])
    worker.stop()  # offloading nothing, the build serves on the CPU as asked
