"""`dgr-proto check|lock|retire`: lint the dgr.v1 schema, guard wire compatibility against
proto/dgr/v1/shard.lock.json (every field ever published keeps its number, type and name; fields
are only added, and one taken out is first retired: `dgr-proto retire field Message.name`, then
`reserved` in its message), and check that the installed generated code is that of the schema in the
checkout. The code itself is generated when dgr-wire is built (hatch_build.py); a development
install regenerates it whenever the schema changes (uv's cache keys). A checkout tool: the runtime
never imports it."""

from __future__ import annotations

import argparse
import filecmp
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from dgr_wire.protolint import compatibility_problems, lint_problems, retire, snapshot

SCHEMA = Path("dgr/v1/shard.proto")
GENERATED = ["dgr/v1/shard_pb2.py", "dgr/v1/shard_pb2.pyi", "dgr/v1/shard_pb2_grpc.py"]


def proto_root(start: Path | None = None) -> Path:
    """The checkout's proto/ (searched upward from `start`, else from this file and the cwd)."""
    starts = [start] if start else [Path(__file__).resolve(), Path.cwd().resolve()]
    for s in starts:
        for d in (s, *s.parents):
            if (d / "proto" / SCHEMA).is_file():
                return d / "proto"
    raise SystemExit(f"dgr-proto: no proto/{SCHEMA} above {', '.join(map(str, starts))}")


def stale(proto: Path) -> list[str]:
    """Generated files of the installed dgr.v1 that differ from what the schema generates now."""
    import dgr.v1

    installed = Path(next(iter(dgr.v1.__path__))).parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{proto}", f"--python_out={tmp}"]
        cmd += [f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", str(proto / SCHEMA)]
        subprocess.run(cmd, check=True)
        return [
            rel
            for rel in GENERATED
            if not (installed / rel).is_file()
            or not filecmp.cmp(Path(tmp) / rel, installed / rel, shallow=False)
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dgr-proto")
    parser.add_argument("action", choices=["check", "lock", "retire"], nargs="?", default="check")
    parser.add_argument("kind", nargs="?", choices=["message", "field", "rpc"], help="retire: what")
    parser.add_argument("name", nargs="?", help="retire: Message, Message.field or Service.Rpc")
    args = parser.parse_args(argv)
    proto = proto_root()
    lock = proto / "dgr" / "v1" / "shard.lock.json"
    recorded = json.loads(lock.read_text())
    if args.action == "retire":
        if not args.kind or not args.name:
            parser.error("retire needs KIND NAME (message X, field X.y, rpc Service.Method)")
        try:
            updated = retire(recorded, args.kind, args.name)
        except KeyError:
            print(f"dgr-proto: the lock holds no {args.kind} {args.name}", file=sys.stderr)
            return 1
        lock.write_text(json.dumps(updated, indent=2, sort_keys=True) + "\n")
        print(f"retired {args.kind} {args.name} in {lock}")
        return 0
    if args.action == "lock":
        # only additions are recorded: anything published that is gone must be retired first
        if gone := [p for p in compatibility_problems(recorded) if "removed" in p]:
            for p in gone:
                print(f"dgr-proto: {p} (dgr-proto retire it first)", file=sys.stderr)
            return 1
        fresh = snapshot()
        if "retired" in recorded:
            fresh["retired"] = recorded["retired"]
        lock.write_text(json.dumps(fresh, indent=2, sort_keys=True) + "\n")
        print(f"wrote {lock}")
        return 0
    problems = [
        f"installed {p} is not generated from {proto / SCHEMA} "
        "(`uv sync --reinstall-package dgr-wire` regenerates it)"
        for p in stale(proto)
    ]
    problems += lint_problems()
    problems += compatibility_problems(recorded)
    for p in problems:
        print(f"proto: {p}")
    if not problems:
        print("proto: generated code current, lint clean, compatible with shard.lock.json")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
