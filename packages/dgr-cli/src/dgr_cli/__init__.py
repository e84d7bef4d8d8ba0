"""`dgr`: one command line for DGR. Each workspace package contributes subcommands through the
`dgr.commands` entry-point group: a callable taking the subparsers object, which adds its parser
and sets `func` (taking the parsed arguments, returning an exit code)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dgr", description="DGR, a distributed GGUF runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    for ep in sorted(entry_points(group="dgr.commands"), key=lambda e: e.name):
        register: Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None] = ep.load()
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
