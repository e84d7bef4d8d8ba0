"""The dgr.v1 schema: installed generated code current, lint, compatibility lock, C++ codegen
compiles."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from dgr_wire import protogen, protolint

REPO = Path(__file__).resolve().parents[3]


def test_generated_python_is_current_and_schema_clean() -> None:
    assert protogen.stale(protogen.proto_root()) == []
    assert protolint.lint_problems() == []
    lock = json.loads((REPO / "proto" / "dgr" / "v1" / "shard.lock.json").read_text())
    assert protolint.compatibility_problems(lock) == []


def test_compatibility_guard_catches_a_renumbered_field() -> None:
    lock = json.loads((REPO / "proto" / "dgr" / "v1" / "shard.lock.json").read_text())
    lock["messages"]["Boundary"]["payload"][0] = 9
    lock["messages"]["Gone"] = {"x": [1, 9, False, ""]}
    problems = protolint.compatibility_problems(lock)
    assert "field Boundary.payload changed or was removed" in problems
    assert "message Gone was removed" in problems


@pytest.mark.skipif(shutil.which("grpc_cpp_plugin") is None, reason="Debian protobuf-compiler-grpc")
def test_cpp_code_generates_and_compiles(tmp_path: Path) -> None:
    plugin = shutil.which("grpc_cpp_plugin")
    subprocess.run(
        [
            "protoc",
            f"-I{REPO / 'proto'}",
            f"--cpp_out={tmp_path}",
            f"--grpc_out={tmp_path}",
            f"--plugin=protoc-gen-grpc={plugin}",
            "dgr/v1/shard.proto",
        ],
        check=True,
    )
    flags = subprocess.run(
        ["pkg-config", "--cflags", "grpc++", "protobuf"], check=True, capture_output=True, text=True
    ).stdout.split()
    for source in ("shard.pb.cc", "shard.grpc.pb.cc"):
        subprocess.run(
            [
                "c++",
                "-std=c++17",
                "-c",
                "-O0",
                f"-I{tmp_path}",
                *flags,
                str(tmp_path / "dgr" / "v1" / source),
                "-o",
                str(tmp_path / f"{source}.o"),
            ],
            check=True,
        )


def test_retired_parts_stay_retired() -> None:
    """What `dgr-proto retire` took out may not come back under its name, and a retired field's
    number and name stay reserved: the lock as recorded passes, and each way of breaking it is
    named."""
    lock = json.loads((REPO / "proto" / "dgr" / "v1" / "shard.lock.json").read_text())
    assert "OpenSession" in lock["retired"]["rpcs"]["ShardService"]
    assert "positions" in lock["retired"]["fields"]["ForwardRequest"]
    back = protolint.retire(lock, "message", "Boundary")  # as if Boundary had been retired
    assert "message Boundary is retired: it may not come back" in protolint.compatibility_problems(
        back
    )
    unreserved = json.loads(json.dumps(lock))
    unreserved["retired"]["fields"]["ForwardRequest"]["chunk_index_old"] = [99, 13, False, ""]
    problems = protolint.compatibility_problems(unreserved)
    assert any("ForwardRequest.chunk_index_old is retired" in p for p in problems), problems
    with pytest.raises(KeyError):
        protolint.retire(lock, "field", "ForwardRequest.no_such_field")
    # and a removal that was not retired first is still a removal
    lock["services"]["ShardService"]["OpenSession"] = ["OpenSessionRequest", "X", False, False]
    assert "rpc ShardService.OpenSession changed or was removed" in (
        protolint.compatibility_problems(lock)
    )
