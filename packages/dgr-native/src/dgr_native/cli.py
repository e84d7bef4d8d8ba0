"""`dgr-native build`: build (or check) the engine module; prints its path."""

from __future__ import annotations

import argparse
import sys

from dgr_native.build import build_engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dgr-native")
    parser.add_argument("command", choices=["build"])
    parser.add_argument("--lane", default="cpu")
    args = parser.parse_args(argv)
    print(build_engine(args.lane))
    return 0


if __name__ == "__main__":
    sys.exit(main())
