"""Build ShardEngine and its Python module (native/engine) against the patched llama.cpp build.

llama.cpp is built once per commit and lane by dgr_llamacpp.build (cached, outside the tree); the
engine project is small and links to it, so a Python-only change rebuilds nothing native and an
engine change recompiles only the engine.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from pathlib import Path

import pybind11
from dgr_llamacpp.build import BuildError, build, build_root, configure, run_step
from dgr_llamacpp.workspace import NativeWorkspace, open_workspace
from dgr_prd.paths import find_root


def workspace() -> NativeWorkspace:
    """The native workspace of the checkout this package's source lives in (an editable install),
    whatever the working directory: `dgr worker` or `dgr --version` run from anywhere build and
    load that checkout's engine, not one found above the current directory."""
    return open_workspace(find_root(Path(__file__).resolve().parent))


def engine_source(repo_root: Path) -> Path:
    return repo_root / "native" / "engine"


def checkout_key(source: Path) -> str:
    """Build directories are per checkout as well: CMake ties a build tree to one source path."""
    return hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:10]


def build_identity(lane: str) -> dict[str, str]:
    """What the engine and worker are built from, compiled into them (CMake cache variables):
    the pinned llama.cpp commit, the patch stack's hash and the lane."""
    from dgr_prd.native_pin import patch_stack_hash

    ws = workspace()
    return {
        "DGR_LLAMA_COMMIT": ws.pin.commit,
        "DGR_PATCH_STACK_SHA256": patch_stack_hash(ws.patches) or "",
        "DGR_LANE": lane,
    }


def configure_engine(lane: str, variant: str, llama_lane: str, extra: list[str]) -> Path:
    """Configure native/engine in its own build directory (per checkout, lane and variant) over
    the `llama_lane` build of the patched llama.cpp; returns the directory."""
    ws = workspace()
    llama_bin = build(ws, llama_lane, ["llama"], log=sys.stderr)
    source = engine_source(ws.repo.root)
    identity = build_identity(lane)
    out = engine_build_dir(variant or lane)
    args = [
        "cmake",
        "-S",
        str(source),
        "-B",
        str(out),
        "-G",
        "Ninja",
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DDGR_LLAMA_SOURCE={ws.patched}",
        f"-DDGR_LLAMA_BIN={llama_bin}",
        *(f"-D{k}={v}" for k, v in identity.items()),
        *extra,
        "-DDGR_BUILD_WORKER=ON",
    ]
    configure(args, out, sys.stderr)
    return out


def engine_build_dir(lane: str) -> Path:
    """Where this checkout's engine and worker for `lane` are built."""
    return build_root() / f"engine-{checkout_key(engine_source(workspace().repo.root))}-{lane}"


def is_built(lane: str) -> bool:
    """This checkout has an engine module and a worker for `lane` (built once; maybe stale)."""
    out = engine_build_dir(lane)
    return (out / "dgr-shard-worker").is_file() and any(out.glob("_dgr_engine*.so"))


def build_engine(lane: str = "cpu") -> Path:
    """Return the path of the built `_dgr_engine` module, building what is stale."""
    out = configure_engine(
        lane,
        "",
        lane,
        [f"-Dpybind11_DIR={pybind11.get_cmake_dir()}", f"-DPython_EXECUTABLE={sys.executable}"],
    )
    run_step(
        ["cmake", "--build", str(out), "--target", "_dgr_engine", "dgr-shard-worker", "dgr-netsim"],
        sys.stderr,
    )
    found = sorted(out.glob("_dgr_engine*.so"))
    if not found:
        raise BuildError(f"_dgr_engine was not produced in {out}")
    return found[0]


@functools.cache
def netsim_binary(lane: str = "cpu") -> Path:
    """The dgr-netsim executable (the benches' simulated WAN link), built beside the worker."""
    return build_engine(lane).parent / "dgr-netsim"


@functools.cache
def worker_binary(lane: str = "cpu") -> Path:
    """The dgr-shard-worker executable, built beside the engine module (checked once per
    process: starting many workers should not run the build check each time)."""
    return build_engine(lane).parent / "dgr-shard-worker"
