"""Hatch build hook: generate the dgr.v1 Python code (messages, typing stubs, gRPC stubs) from the
one wire schema, proto/dgr/v1/shard.proto, with grpcio-tools, whenever this package is built or
installed (wheel or editable). The generated files are build outputs: never committed, never
edited. The schema comes from the checkout (../../proto) or, in an sdist, from its own copy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SCHEMA = "dgr/v1/shard.proto"
HEADER = "# Generated from proto/dgr/v1/shard.proto when dgr-wire is built; do not edit.\n"


def proto_root(package: Path) -> Path:
    for root in (package / "proto", package.parent.parent / "proto"):
        if (root / SCHEMA).is_file():
            return root
    raise FileNotFoundError(f"{SCHEMA} not found beside {package} or in the checkout's proto/")


def generate(proto: Path, out: Path) -> list[Path]:
    """protoc's Python, .pyi and gRPC output for the schema, under out/dgr/v1."""
    cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{proto}", f"--python_out={out}"]
    cmd += [f"--pyi_out={out}", f"--grpc_python_out={out}", str(proto / SCHEMA)]
    subprocess.run(cmd, check=True)
    inits = [out / "dgr" / "__init__.py", out / "dgr" / "v1" / "__init__.py"]
    for init in inits:
        init.write_text(HEADER, encoding="utf-8")
    return [*inits, *sorted((out / "dgr" / "v1").glob("shard_pb2*"))]


class WireCodegen(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        package = Path(self.root)
        if self.target_name == "sdist":
            return
        generate(proto_root(package), package / "src")
