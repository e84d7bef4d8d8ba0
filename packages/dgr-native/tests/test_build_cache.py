"""A second build does no native work: llama.cpp and the engine are cached outside the tree."""

from __future__ import annotations

import subprocess

from dgr_llamacpp.build import build, build_dir
from dgr_llamacpp.workspace import open_workspace
from dgr_native.build import build_engine


def test_rebuild_after_a_python_only_change_compiles_nothing() -> None:
    ws = open_workspace()
    module = build_engine()
    mtime = module.stat().st_mtime_ns
    build(ws, "cpu", ["llama"])
    assert build_engine() == module and module.stat().st_mtime_ns == mtime
    for directory, target in ((build_dir(ws, "cpu"), "llama"), (module.parent, "_dgr_engine")):
        dry = subprocess.run(
            ["ninja", "-C", str(directory), "-n", target],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "no work to do" in dry, directory
