"""`dgr`: one command line for DGR. Each workspace package contributes subcommands through the
`dgr.commands` entry-point group: a callable taking the subparsers object, which adds its parser
and sets `func` (taking the parsed arguments, returning an exit code)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points, version
from typing import Any


def version_text() -> str:
    """`dgr --version`: this command's version, then the build identity compiled into the engine
    this installation runs (llama.cpp commit, patch stack, lane, schema) and where it is."""
    from dgr_route.engine import EngineNotFound, locate

    lines = [f"dgr {version('dgr-cli')}"]
    try:
        engine = locate()
        info = engine.build_info()
        lines.append("engine: " + " ".join(f"{k}={v}" for k, v in info.items()))
        lines.append(f"engine directory: {engine.directory} ({engine.source})")
    except EngineNotFound as exc:
        lines.append(f"engine: none ({exc})")
    return "\n".join(lines)


class _Version(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, **_: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the build identity and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dgr", description="DGR, a distributed GGUF runtime")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)
    for ep in sorted(entry_points(group="dgr.commands"), key=lambda e: e.name):
        register: Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None] = ep.load()
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # a command that passes the options it does not know on (`dgr worker`: to the worker, whose
    # option table is the only one) gets them as args.unknown; any other command refuses them
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "forwards_unknown", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.unknown = unknown
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
