"""The build identity is compiled into the engine and the worker (as llama.cpp's build-info): what
they report is the pin and the patch stack they were built from, wherever they run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dgr_native import load
from dgr_native.build import worker_binary
from dgr_prd.native_pin import llama_pin, patch_stack_hash
from dgr_prd.paths import find_root


def expected() -> dict[str, object]:
    repo = find_root()
    pin = llama_pin(repo.llama_manifest)
    assert pin is not None
    return {
        "llama_commit": pin["commit"],
        "patch_stack_sha256": patch_stack_hash(repo.patches),
        "lane": "cpu",
        "schema_version": 1,
    }


def test_engine_reports_what_it_was_built_from() -> None:
    assert load().build_info() == expected()


def test_worker_version_outside_the_checkout(tmp_path: Path) -> None:
    out = subprocess.run(
        [str(worker_binary()), "--version"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout.split()
    e = expected()
    assert out == [
        "dgr-shard-worker",
        "llama.cpp",
        e["llama_commit"],
        "patches",
        e["patch_stack_sha256"],
        "lane",
        "cpu",
        "schema",
        "1",
    ]


def test_dgr_version_names_the_engine_build(tmp_path: Path) -> None:
    out = subprocess.run(
        [str(Path(sys.executable).parent / "dgr"), "--version"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout
    e = expected()
    assert out.splitlines()[0].startswith("dgr 0.")
    assert f"llama_commit={e['llama_commit']}" in out
    assert f"patch_stack_sha256={e['patch_stack_sha256']}" in out
