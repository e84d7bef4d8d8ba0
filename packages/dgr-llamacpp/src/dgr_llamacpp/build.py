"""Build the patched llama.cpp tree with CMake and Ninja into a persistent, cached build dir.

The build directory lives outside the work tree ($DGR_CACHE/build/...), keyed by commit and lane,
so that every checkout on a machine shares it; ccache makes a fresh build directory cheap where
objects were compiled before. Only changed files recompile: the patched tree keeps the mtimes
of files no patch touched (see patches.apply_stack).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TextIO

from dgr_artifacts.downloads import cache_dir

from dgr_llamacpp.fetch import fetch
from dgr_llamacpp.lanedeps import lane_cmake_args
from dgr_llamacpp.patches import apply_stack
from dgr_llamacpp.workspace import NativeWorkspace

# FACTS.md: these CPUs advertise AMX but the VM does not enable it; a -march=native build then
# dies with SIGILL in ggml_backend_amx_mul_mat. Users' machines can hit the same.
AMX_OFF = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# DGR's lanes compute through ggml's own threadpool, which the engine creates and tunes, not
# OpenMP: OpenMP gives every thread that calls llama_decode a team of its own, a worker calls from
# gRPC's many handler threads, and once the teams outnumber the cores libgomp stops spinning at
# barriers and sleeps on a futex at every op (measured: a 1-stage route at 2 threads ran at a
# third of the same engine in one process). ggml's pool has fixed workers whatever the caller,
# spins only inside a graph, and sleeps between graphs (the engine's `poll`), so an idle stage
# leaves the cores to the one computing.
NO_OPENMP = "-DGGML_OPENMP=OFF"
LANE_OPTIONS = {
    "cpu": [NO_OPENMP],
    # llama.cpp's own RPC backend as it ships (OpenMP on): the bench's baseline
    "cpu-rpc": ["-DGGML_RPC=ON"],
    "cuda": [NO_OPENMP, "-DGGML_CUDA=ON"],
    "rocm": [NO_OPENMP, "-DGGML_HIP=ON"],
    "vulkan": [NO_OPENMP, "-DGGML_VULKAN=ON"],
    "metal": [NO_OPENMP, "-DGGML_METAL=ON"],
    # libFuzzer harnesses (nox -s fuzz): clang, with ASan, UBSan and coverage instrumentation of
    # llama.cpp itself, so that the patched range-ownership loader is fuzzed, not just called
    "fuzz": [NO_OPENMP, "-DCMAKE_C_COMPILER=clang-14", "-DCMAKE_CXX_COMPILER=clang++-14"],
}
# compile flags a lane adds to every file (after the AMX ones). llama.cpp gets ASan and coverage
# but not UBSan: ggml calls its kernels through cast function pointers and the GGUF reader loads
# enums before checking them, undefined behaviour UBSan aborts on in every decode and at the
# first mutated type tag. DGR's own code (engine, worker, harnesses) gets UBSan as well.
FUZZ_FLAGS = "-fsanitize=address,fuzzer-no-link -gline-tables-only"
FUZZ_DGR_FLAGS = (
    "-fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=undefined -gline-tables-only"
)
LANE_FLAGS = {"fuzz": FUZZ_FLAGS}
LANE_TARGETS = {"fuzz": ["llama"]}  # what a lane builds by default (others: DEFAULT_TARGETS)
DEFAULT_TARGETS = ["llama", "llama-gguf-split", "llama-completion", "llama-bench"]


class BuildError(Exception):
    pass


def cmake_args(source: Path, build: Path, lane: str) -> list[str]:
    if lane not in LANE_OPTIONS:
        raise BuildError(f"unknown lane {lane!r}; known: {', '.join(LANE_OPTIONS)}")
    flags = AMX_OFF if platform.machine() in ("x86_64", "AMD64") else ""
    flags = " ".join(f for f in (flags, LANE_FLAGS.get(lane, "")) if f)
    return [
        "cmake",
        "-S",
        str(source),
        "-B",
        str(build),
        "-G",
        "Ninja",
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=ON",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        # llama-server is configured but built only where asked for (bench-serve's reference),
        # without its web UI: the UI's assets come from npm or a download, neither of which a
        # build here may need
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_CURL=OFF",
        f"-DGGML_CCACHE={'ON' if shutil.which('ccache') else 'OFF'}",
        f"-DCMAKE_C_FLAGS={flags}",
        f"-DCMAKE_CXX_FLAGS={flags}",
        *LANE_OPTIONS[lane],
    ]


def build_root() -> Path:
    """Where every native build directory lives ($DGR_BUILD_DIR, default $DGR_CACHE/build)."""
    return Path(os.environ.get("DGR_BUILD_DIR", cache_dir() / "build"))


def build_dir(ws: NativeWorkspace, lane: str) -> Path:
    return build_root() / f"llama.cpp-{ws.pin.commit[:12]}-{lane}"


def run_step(cmd: list[str], log: TextIO) -> None:
    """Run one build command, its output to `log`; a failure is a BuildError."""
    log.write("+ " + " ".join(cmd) + "\n")
    log.flush()
    done = subprocess.run(
        cmd, stdout=log if log is not sys.stdout else None, stderr=subprocess.STDOUT, check=False
    )
    if done.returncode != 0:
        raise BuildError(f"{cmd[0]} failed with exit code {done.returncode}")


def configure(args: list[str], build: Path, log: TextIO) -> None:
    """Run the CMake configure `args` into `build` unless the same arguments already did."""
    args_hash = hashlib.sha256(json.dumps(args).encode()).hexdigest()
    stamp = build / ".dgr-configure"
    if not stamp.is_file() or stamp.read_text().strip() != args_hash:
        build.mkdir(parents=True, exist_ok=True)
        (build / "CMakeCache.txt").unlink(missing_ok=True)  # it may name another source dir
        run_step(args, log)
        stamp.write_text(args_hash + "\n")


def build(
    ws: NativeWorkspace,
    lane: str = "cpu",
    targets: list[str] | None = None,
    log: TextIO = sys.stdout,
) -> Path:
    """Fetch, patch and build; return the directory holding the built binaries and libraries."""
    pristine = fetch(ws.pin, ws.root, log)
    source, _ = apply_stack(pristine, ws.patched, ws.patches)
    build = build_dir(ws, lane)
    configure([*cmake_args(source, build, lane), *lane_cmake_args(ws.repo.root, lane)], build, log)
    jobs = str(os.cpu_count() or 2)
    run_step(
        [
            "cmake",
            "--build",
            str(build),
            "-j",
            jobs,
            "--target",
            *(targets or LANE_TARGETS.get(lane, DEFAULT_TARGETS)),
        ],
        log,
    )
    return build / "bin"


def tool(ws: NativeWorkspace, name: str, lane: str = "cpu") -> Path:
    """Path of a built llama.cpp tool, building it first if needed (a no-op when current)."""
    path = build(ws, lane, [name], log=sys.stderr) / name
    if not path.is_file():
        raise BuildError(f"{name} was not produced in {path.parent}")
    return path
