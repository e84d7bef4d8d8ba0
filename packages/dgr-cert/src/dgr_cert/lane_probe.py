"""`nox -s lane-probe -- --lane vulkan`: a non-CPU lane's routes against the CPU lane in one
process, before any certification (issue 16).

Workers built for the lane (`dgr-native build --lane L`) serve each layout with every owned layer
on the lane's device (`--gpu-layers -1`); the route's logits are compared step by step with the
CPU lane's whole model in this process on the same prompt. Each step's NMSE is reported, with
top-1 agreement and greedy identity, against issue 16's certification bar (NMSE <= 1e-4, greedy
tokens equal). A step after the first greedy divergence compares different contexts, so only
the steps up to it count. Writes evidence/bench/lane-<lane>.json. This probes, and certifies
nothing: records come from `nox -s certify`.

Mesa's lavapipe (`llvmpipe`) is a Vulkan device of type CPU, which ggml-vulkan skips unless it is
named: the probe sets GGML_VK_VISIBLE_DEVICES=0 when nothing else is set.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from typing import Any

import numpy as np
from dgr_cli.workers import descriptor_args, start_worker
from dgr_native.parity import reference_run
from dgr_records import report, write_bench
from dgr_route.route import Route

BAR_NMSE = 1e-4
# per model: layouts of (first, last, on the probed lane?): all-lane routes, and mixed routes
# with CPU stages among them. SmolLM2 is Q4_1, where the CPU lane quantizes activations to Q8_1
# for its integer dot products and a lane without them does not; qwen2-twin is f32 throughout.
LAYOUTS: dict[str, list[list[tuple[int, int, bool]]]] = {
    "smollm2-135m-q4_1": [
        [(0, 30, True)],
        [(0, 15, True), (15, 30, True)],
        [(0, 10, True), (10, 20, True), (20, 30, True)],
        [(0, 15, False), (15, 30, True)],
    ],
    "qwen2-twin": [
        [(0, 8, True)],
        [(0, 4, True), (4, 8, True)],
        [(0, 3, True), (3, 6, True), (6, 8, True)],
        [(0, 4, False), (4, 8, True)],
        [(0, 3, True), (3, 6, False), (6, 8, True)],
    ],
}
DECODE = 16


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sum((got - want) ** 2) / np.sum(want**2))


def device_name(lane: str = "vulkan") -> str:
    """The lane's device as its driver reports it (the hardware fingerprint's vulkaninfo and
    nvidia-smi readings), or what is missing."""
    from dgr_native.lanes import devices
    from dgr_prd.hardware import gpus, vulkan_devices
    from dgr_prd.model import Lane

    found = devices(Lane(lane), {"gpus": gpus(), "vulkan_devices": vulkan_devices()})
    if found:
        return found[0]
    if lane == "cuda" and shutil.which("nvidia-smi") is None:
        return "unknown (nvidia-smi not found: the NVIDIA driver is not installed)"
    if lane == "vulkan" and shutil.which("vulkaninfo") is None:
        return "unknown (vulkaninfo not installed: apt-get install vulkan-tools)"
    return "none"


# the architectures the CUDA lane is built for (native/llama.cpp/lane-deps.json)
CUDA_ARCHS = ("9.0",)


class PreflightError(Exception):
    pass


def preflight_cuda() -> dict[str, str]:
    """What a CUDA certification needs on the GPU machine, checked before anything runs: the
    driver (nvidia-smi, libcuda.so.1), a GPU of an architecture the build has, and the CUDA
    build with every library it links resolvable. Returns the readings; a miss raises
    PreflightError saying what is missing and how to get it (the machine may reach no registry:
    the build and its toolkit libraries come from a machine that does, under $DGR_CACHE)."""
    import ctypes
    import subprocess

    from dgr_native.build import engine_build_dir, is_built

    if shutil.which("nvidia-smi") is None:
        raise PreflightError("nvidia-smi not found: the NVIDIA driver is not installed")
    query = "--query-gpu=name,driver_version,compute_cap"
    smi = subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True, check=False
    )
    rows = [[p.strip() for p in line.split(",")] for line in smi.stdout.splitlines() if line]
    if smi.returncode != 0 or not rows:
        raise PreflightError(
            f"nvidia-smi lists no GPU (exit {smi.returncode}): {smi.stderr[-300:]}"
        )
    usable = [r for r in rows if len(r) == 3 and r[2] in CUDA_ARCHS]
    if not usable:
        raise PreflightError(
            f"the CUDA lane is built for compute capability {', '.join(CUDA_ARCHS)}; "
            f"this machine has {'; '.join(' '.join(r) for r in rows)}"
        )
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise PreflightError(f"the driver's libcuda.so.1 does not load: {e}") from e
    if not is_built("cuda"):
        want = engine_build_dir("cuda")
        others = sorted(p.name for p in want.parent.glob("engine-*-cuda") if p != want)
        elsewhere = (
            f" ({', '.join(others)} is another checkout's: build directories are named by the "
            "checkout's path, so run from the path it was built at)"
            if others
            else ""
        )
        raise PreflightError(
            f"no CUDA build in {want}{elsewhere}: run `nox -s native-build -- --lane cuda` on a "
            "machine that reaches PyPI, and bring $DGR_CACHE/build and $DGR_CACHE/lane-deps "
            "with this checkout"
        )
    build = engine_build_dir("cuda")
    unresolved = []
    for binary in [build / "dgr-shard-worker", *sorted(build.glob("_dgr_engine*.so"))]:
        ldd = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=False)
        unresolved += [line.split()[0] for line in ldd.stdout.splitlines() if "not found" in line]
    if unresolved:
        missing = ", ".join(sorted(set(unresolved)))
        raise PreflightError(
            f"the CUDA build links libraries this machine cannot find: {missing} "
            "(the toolkit's wheels unpack under $DGR_CACHE/lane-deps: bring it along)"
        )
    name, driver, arch = usable[0]
    return {"gpu": name, "driver": driver, "compute_capability": arch, "build": str(build)}


def probe(
    lane: str,
    name: str,
    layout: list[tuple[int, int, bool]],
    reference: tuple[np.ndarray, list[np.ndarray], list[int]],
) -> dict[str, Any]:
    """One layout of `name` against `reference`, the CPU lane's (prompt, logits, tokens) in this
    process: each stage on `lane` (every layer on its device) or, where marked so, on the CPU."""
    from dgr_artifacts.models import model_path

    model = model_path(name)
    prompt, ref_logits, ref_tokens = reference
    descriptor = descriptor_args(model)
    workers = [
        start_worker(
            model, a, b, descriptor=descriptor, n_ctx=512, lane=lane, extra=["--gpu-layers", "-1"]
        )
        if on_lane
        else start_worker(model, a, b, descriptor=descriptor, n_ctx=512)
        for a, b, on_lane in layout
    ]
    try:
        route = Route.open([w.address for w in workers], timeout=600)
        lanes = route.lanes
        t0 = time.perf_counter()
        trace = list(route.trace([int(t) for t in prompt], len(ref_logits)))
        seconds = time.perf_counter() - t0
        route.close()
    finally:
        for w in workers:
            w.stop()
    tokens = [t for t, _ in trace]
    differ = [i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)) if a != b]
    same = differ[0] if differ else len(tokens)
    # step i's logits follow the same context while every token before it agreed
    compared = range(min(same + 1, len(trace)))
    steps = [nmse(trace[i][1], ref_logits[i]) for i in compared]
    max_abs = max(float(np.max(np.abs(trace[i][1] - ref_logits[i]))) for i in compared)
    return {
        "model": name,
        "layout": [[a, b] for a, b, _ in layout],
        "stage_lanes": lanes,
        "steps_compared": len(steps),
        "nmse_per_step": [round(v, 8) for v in steps],
        "nmse_max": max(steps),
        "max_abs_logit_diff": max_abs,
        "top1_first_step_equal": bool(int(np.argmax(trace[0][1])) == int(np.argmax(ref_logits[0]))),
        "greedy_identical": tokens == ref_tokens,
        "first_divergence": same if same < len(tokens) else None,
        "seconds": round(seconds, 2),
        "meets_bar": max(steps) <= BAR_NMSE and tokens == ref_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dgr_cert.lane_probe")
    parser.add_argument("--lane", required=True, choices=["vulkan", "cuda"])
    args = parser.parse_args(argv)
    if args.lane == "vulkan":
        os.environ.setdefault("GGML_VK_VISIBLE_DEVICES", "0")
    from dgr_artifacts.models import model_path

    rows = []
    for name, layouts in LAYOUTS.items():
        reference = reference_run(model_path(name), DECODE)  # once per model, not per layout
        rows += [probe(args.lane, name, layout, reference) for layout in layouts]
    for r in rows:
        greedy = (
            "identical" if r["greedy_identical"] else f"diverges at step {r['first_divergence']}"
        )
        print(
            f"{r['model']} {r['layout']} {'+'.join(r['stage_lanes'])}: "
            f"NMSE per step {r['nmse_per_step'][:4]}... "
            f"max {r['nmse_max']:.2e} over {r['steps_compared']} steps, greedy "
            f"{greedy}, "
            f"{r['seconds']} s; bar (NMSE <= {BAR_NMSE:g}, tokens equal): "
            f"{'met' if r['meets_bar'] else 'MISSED'}",
            flush=True,
        )
    result = {
        "lane": args.lane,
        "device": device_name(args.lane),
        "env": {k: v for k, v in os.environ.items() if k.startswith("GGML_VK_")},
        "bar": {"nmse_max": BAR_NMSE, "greedy_identical": True},
        "rows": rows,
        "measured_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_bench(f"lane-{args.lane}", result)
    report(
        f"lane_{args.lane}",
        {
            "nmse_max": max(r["nmse_max"] for r in rows),
            "greedy_identical_all": all(r["greedy_identical"] for r in rows),
            "meets_bar": all(r["meets_bar"] for r in rows),
        },
    )
    print(f"device: {result['device']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
