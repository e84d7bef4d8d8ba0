"""Where the runtime finds the engine (dgr_route.engine.locate) and what `dgr worker` says when
the engine or the model is not there: a typed error naming what is missing, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from dgr_route.engine import ENV, EngineNotFound, locate

DGR = str(Path(sys.executable).parent / "dgr")


def run_dgr(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [DGR, *args], capture_output=True, text=True, check=False, env={**os.environ, **(env or {})}
    )


def test_a_checkout_finds_its_development_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    engine = locate()
    assert engine.source.startswith("entry point dgr_native")
    assert engine.worker.is_file() and os.access(engine.worker, os.X_OK)
    assert engine.build_info()["lane"] == "cpu"


def test_the_environment_variable_wins_and_is_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, str(tmp_path))
    with pytest.raises(
        EngineNotFound, match=r"\$DGR_ENGINE_DIR names .* which has no dgr-shard-worker"
    ):
        locate()
    # a directory with a worker but no module: found, and loading the module says what is missing
    (tmp_path / "dgr-shard-worker").write_text("")
    engine = locate()
    assert engine.directory == tmp_path
    with pytest.raises(EngineNotFound, match="no _dgr_engine module"):
        engine.module()
    # a module that is not one (or a second engine in a process that runs one) is refused by name
    (tmp_path / "_dgr_engine.cpython-311-x86_64-linux-gnu.so").write_bytes(b"not an ELF file")
    with pytest.raises(EngineNotFound, match=r"already runs the engine|cannot load"):
        engine.module()


@pytest.mark.fleet  # runs `dgr worker` (which would start one)
def test_dgr_worker_without_engine_or_model_fails_by_name(tmp_path: Path) -> None:
    done = run_dgr("worker", "--layers", "0:15", "--model", str(tmp_path / "absent.gguf"))
    assert done.returncode == 2 and "absent.gguf: file does not exist" in done.stderr
    assert "Traceback" not in done.stderr
    done = run_dgr("worker", "--layers", "0:15", env={ENV: str(tmp_path)})
    assert done.returncode == 2 and "has no dgr-shard-worker" in done.stderr
    assert "Traceback" not in done.stderr
