"""Where this installation's native engine is: the `_dgr_engine` module (a local vocabulary, the
build identity) and the `dgr-shard-worker` executable, side by side in one directory. Looked up
in order:

1. `$DGR_ENGINE_DIR`, a directory holding both (a build copied to a worker machine);
2. the installed `dgr-engine` wheel (its `dgr_engine` package directory);
3. a `dgr.engine` entry point: in a checkout, dgr-native's development build, built for the
   lane asked for when it is missing or stale.

The runtime never builds anything itself and imports no build tool: the entry point is only
loaded when no engine is installed."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType

ENV = "DGR_ENGINE_DIR"
MODULE = "_dgr_engine"
WORKER = "dgr-shard-worker"


class EngineNotFound(RuntimeError):
    """No engine is installed; says how to get one."""


@dataclass(frozen=True)
class Engine:
    directory: Path
    source: str  # where it was found: the environment variable, the wheel, or the entry point

    @property
    def worker(self) -> Path:
        return self.directory / WORKER

    def module(self) -> ModuleType:
        """The engine module, loaded once per process (one engine per process: asking for
        another directory's after one is loaded is an error)."""
        found = sorted(self.directory.glob(f"{MODULE}*.so"))
        if not found:
            raise EngineNotFound(f"no {MODULE} module in {self.directory} ({self.source})")
        loaded = sys.modules.get(MODULE)
        if loaded is not None:
            if Path(str(loaded.__file__)).resolve() != found[0].resolve():
                raise EngineNotFound(f"this process already runs the engine {loaded.__file__}")
            return loaded
        spec = importlib.util.spec_from_file_location(MODULE, found[0])
        if spec is None or spec.loader is None:
            raise EngineNotFound(f"cannot load {found[0]}")
        try:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except ImportError as exc:  # a shared library the engine links is missing
            raise EngineNotFound(f"cannot load {found[0]} ({self.source}): {exc}") from exc
        sys.modules[MODULE] = module
        return module

    def build_info(self) -> dict[str, object]:
        """The identity compiled in: llama.cpp commit, patch-stack hash, lane, schema version."""
        return dict(self.module().build_info())


def _check(engine: Engine) -> Engine:
    if not engine.worker.is_file():
        raise EngineNotFound(f"{engine.source} names {engine.directory}, which has no {WORKER}")
    return engine


def locate(lane: str | None = None) -> Engine:
    """The engine to run, for `lane` when given (an installed engine of another lane is an
    error naming both)."""
    if os.environ.get(ENV):
        return _check(Engine(Path(os.environ[ENV]), f"${ENV}"))
    spec = importlib.util.find_spec("dgr_engine")
    if spec is not None and spec.submodule_search_locations:
        engine = _check(Engine(Path(next(iter(spec.submodule_search_locations))), "dgr-engine"))
        if lane is not None and (built := engine.build_info().get("lane")) != lane:
            raise EngineNotFound(
                f"the installed dgr-engine is built for lane {built!r}, not {lane!r}"
            )
        return engine
    for ep in entry_points(group="dgr.engine"):
        directory: Callable[[str], Path] = ep.load()
        return _check(Engine(directory(lane or "cpu"), f"entry point {ep.value}"))
    raise EngineNotFound(
        "no DGR engine installed: `pip install dgr_engine-*.whl` (built by `nox -s dist`), "
        f"or set ${ENV} to a directory holding {MODULE} and {WORKER}"
    )
