"""DGR-070: the distributable wheels (`nox -s dist`) install with pip into a fresh virtual
environment outside the checkout, and the README's "Install on a worker machine" block runs there
exactly as written: engine identity, model fetch, manifest and verify, two workers, generation,
the OpenAI server and the demo, with nothing of the checkout importable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from dgr_native.build import worker_binary
from dgr_native.dist import (
    ABSENT,
    PRESENT,
    RUNTIME,
    RUNTIME_TOOLS,
    build_dist,
    check_install,
    runnable,
)

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return build_dist(tmp_path_factory.mktemp("build") / "dist")


def listing(wheel: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "zipfile", "-l", str(wheel)], capture_output=True)
    return out.stdout.decode()


def test_dist_holds_the_engine_and_every_runtime_wheel(dist: list[Path]) -> None:
    names = sorted(w.name.split("-")[0] for w in dist)
    assert names == sorted(["dgr_engine", *(p.replace("-", "_") for p in RUNTIME + RUNTIME_TOOLS)])
    engine = listing(next(w for w in dist if w.name.startswith("dgr_engine-")))
    for member in ("dgr_engine/dgr-shard-worker", "dgr_engine/libllama.so", "dgr_engine/_dgr_"):
        assert member in engine
    assert "libllama.so." not in engine  # one file per library, no versioned copies
    # generated from proto/ when the wheel is built, though never committed
    wire = listing(next(w for w in dist if w.name.startswith("dgr_wire-")))
    assert "dgr/v1/shard_pb2_grpc.py" in wire and "dgr/v1/shard_pb2.pyi" in wire


def test_background_commands_get_free_ports_and_a_readiness_wait() -> None:
    script = runnable(
        "dgr worker --listen 127.0.0.1:7001 &  # one\ndgr generate --route 127.0.0.1:7001\n"
    )
    assert "7001" not in script
    port = script.split("--listen 127.0.0.1:", 1)[1].split()[0]
    assert f"ready {port}\ndgr generate --route 127.0.0.1:{port}" in script


@pytest.mark.fleet  # the block starts two workers, a server and the demo (in a clean environment)
def test_readme_install_block_runs_from_the_wheels_alone(dist: list[Path], tmp_path: Path) -> None:
    run = check_install(dist, tmp_path / "machine", ROOT / "README.md")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    out = run.stdout
    # the identity compiled in, reported by the installed engine (not a development build)
    version = next(line for line in out.splitlines() if line.startswith("engine: "))
    worker = subprocess.run([str(worker_binary()), "--version"], capture_output=True, text=True)
    fields = worker.stdout.split()
    assert f"llama_commit={fields[2]}" in version and f"patch_stack_sha256={fields[4]}" in version
    assert "(dgr-engine)" in out
    assert "verified: all chunks match the manifest" in out
    assert "greedy tokens identical" in out  # the demo's parity check, from the wheels
    # the planner's probe and the bench ran on the installed engine, with no planning tools
    assert "compute: {" in out and '"ms_per_layer"' in out
    bench = out[out.index("1 thread(s) per process") :]
    assert "engine in one process" in bench and "DGR forward 2 stages" in bench
    # the OpenAI server's greedy completion is the text `dgr generate` streamed before it
    text = run.completion_text()
    assert text.strip() and text in out[: out.rindex('{"id"')]
    assert run.importable == {m: True for m in PRESENT} | {m: False for m in ABSENT}
