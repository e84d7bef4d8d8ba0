"""DGR ShardEngine for Python: `load()` builds (if needed) and imports the engine module.

The engine is C++ (native/engine) over patched libllama; `Engine` takes numpy buffers in place
and releases the GIL while llama.cpp computes. Failures raise `ShardError` with a `.status`.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from dgr_native.build import build_engine


@functools.cache
def load(lane: str = "cpu") -> ModuleType:
    """The `_dgr_engine` extension, built for `lane` when missing or stale (checked once per
    process), loaded as the runtime loads it (dgr_route.engine.Engine: one engine per process)."""
    from dgr_route.engine import Engine

    return Engine(build_engine(lane).parent, f"dgr-native's {lane} build").module()


@functools.cache
def engine_dir(lane: str = "cpu") -> Path:
    """The development build's directory (engine module and worker) for `lane`: the runtime's
    `dgr.engine` entry point in a checkout (checked once per process: starting many workers should
    not run the build check each time). The CPU lane is built when missing; another lane must
    have been built once (`dgr-native build --lane L`: it needs its toolchain), and is refused
    otherwise; a built lane is brought up to date."""
    from dgr_route.engine import EngineNotFound

    from dgr_native.build import is_built

    if lane != "cpu" and not is_built(lane):
        raise EngineNotFound(
            f"no {lane} build in this checkout: `dgr-native build --lane {lane}` builds it "
            "(`dgr-native lanes` lists what each lane needs)"
        )
    return build_engine(lane).parent
