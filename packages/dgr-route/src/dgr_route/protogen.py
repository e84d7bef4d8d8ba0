"""`dgr-proto gen|check|lock`: generate the Python code for proto/dgr/v1 (grpcio-tools), check it
is current, lint the schema, and guard wire compatibility against proto/dgr/v1/shard.lock.json
(every field ever published keeps its number, type and name; fields are only added)."""

from __future__ import annotations

import argparse
import filecmp
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from dgr_prd.paths import find_root

from dgr_route.protolint import compatibility_problems, lint_problems, snapshot

PROTO = Path("dgr/v1/shard.proto")
GENERATED = [
    "dgr/__init__.py",
    "dgr/v1/__init__.py",
    "dgr/v1/shard_pb2.py",
    "dgr/v1/shard_pb2.pyi",
    "dgr/v1/shard_pb2_grpc.py",
]
HEADER = "# Generated from proto/dgr/v1/shard.proto by `nox -s proto`; do not edit.\n"


def proto_root() -> Path:
    return find_root().root / "proto"


def package_src() -> Path:
    return find_root().root / "packages" / "dgr-route" / "src"


def generate(out: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{proto_root()}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        str(proto_root() / PROTO),
    ]
    subprocess.run(cmd, check=True)
    for init in ("dgr/__init__.py", "dgr/v1/__init__.py"):
        (out / init).write_text(HEADER, encoding="utf-8")


def stale(out: Path) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        return [
            rel
            for rel in GENERATED
            if not (out / rel).is_file()
            or not filecmp.cmp(Path(tmp) / rel, out / rel, shallow=False)
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dgr-proto")
    parser.add_argument("action", choices=["gen", "check", "lock"], nargs="?", default="check")
    args = parser.parse_args(argv)
    lock = proto_root() / "dgr" / "v1" / "shard.lock.json"
    if args.action == "gen":
        shutil.rmtree(package_src() / "dgr", ignore_errors=True)
        generate(package_src())
        print(f"generated {', '.join(GENERATED)} under {package_src()}")
        return 0
    if args.action == "lock":
        lock.write_text(json.dumps(snapshot(), indent=2, sort_keys=True) + "\n")
        print(f"wrote {lock}")
        return 0
    problems = [
        f"stale generated file {p} (run `nox -s proto -- gen`)" for p in stale(package_src())
    ]
    problems += lint_problems()
    problems += compatibility_problems(json.loads(lock.read_text()))
    for p in problems:
        print(f"proto: {p}")
    if not problems:
        print("proto: generated code current, lint clean, compatible with shard.lock.json")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
