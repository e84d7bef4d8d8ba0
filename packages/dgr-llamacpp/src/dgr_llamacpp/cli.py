"""`dgr-llamacpp`: fetch and verify the pinned llama.cpp, manage the numbered patch stack."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dgr_prd.native_pin import patch_stack_hash
from dgr_records import report

from dgr_llamacpp import patches
from dgr_llamacpp.build import DEFAULT_TARGETS, LANE_OPTIONS, BuildError, build
from dgr_llamacpp.fetch import PinError, archs_in_tree, fetch
from dgr_llamacpp.tree import tree_hash
from dgr_llamacpp.workspace import NativeWorkspace, open_workspace


def cmd_fetch(ws: NativeWorkspace, args: argparse.Namespace) -> int:
    tree = fetch(ws.pin, ws.root)
    archs = archs_in_tree(tree)
    print(f"pinned llama.cpp {ws.pin.commit} ({ws.pin.release}) at {tree}")
    print(
        f"architectures in the tree: {len(archs)}; required present: "
        f"{', '.join(a for a in ws.pin.required_archs if a in archs)}"
    )
    report(
        "pin",
        {
            "commit": ws.pin.commit,
            "release": ws.pin.release,
            "archive_sha256": ws.pin.sdist().sha256,
            "tree_sha256": ws.pin.tree_sha256,
            "tree_verified": True,
            "archs_in_tree": len(archs),
            "has_deepseek4": "deepseek4" in archs,
        },
    )
    return 0


def cmd_patches(ws: NativeWorkspace, args: argparse.Namespace) -> int:
    stack = patches.load_stack(ws.patches)
    if args.action == "list":
        for p in stack:
            print(f"{p.name}  {p.story}  {p.what}")
        return 0
    pristine = fetch(ws.pin, ws.root)
    if args.action == "check":
        for line in patches.check_stack(pristine, stack, ws.pin.tree_sha256):
            print(line)
        report(
            "patches",
            {
                "count": len(stack),
                "applies_cleanly": True,
                "reverses_to_pin": True,
                "stack_sha256": patch_stack_hash(ws.patches) or "empty",
            },
        )
        return 0
    if args.action == "apply":
        tree, changed = patches.apply_stack(pristine, ws.patched, ws.patches)
        print(f"{'applied' if changed else 'already current'}: {len(stack)} patches in {tree}")
        return 0
    if args.action == "reverse":
        for p in reversed(stack):
            patches.apply_patch(ws.patched, p, reverse=True)
        (ws.patched / patches.STAMP).unlink(missing_ok=True)
        actual = tree_hash(ws.patched)
        if actual != ws.pin.tree_sha256:
            print(f"reversed tree {actual} differs from the pin", file=sys.stderr)
            return 1
        print(f"reversed {len(stack)} patches; {ws.patched} equals the pin again")
        return 0
    written = patches.refresh(ws.patched, ws.patches)
    print(f"regenerated {len(written)} patch files from {ws.patched}")
    return 0


def cmd_build(ws: NativeWorkspace, args: argparse.Namespace) -> int:
    bin_dir = build(ws, args.lane, args.target or None)
    print(f"built {', '.join(args.target or DEFAULT_TARGETS)} ({args.lane}) into {bin_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dgr-llamacpp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", help="fetch and verify the pinned tree").set_defaults(func=cmd_fetch)
    b = sub.add_parser("build", help="build the patched tree (cached, outside the work tree)")
    b.add_argument("--lane", default="cpu", choices=sorted(LANE_OPTIONS))
    b.add_argument("--target", action="append", help="CMake target (repeatable)")
    b.set_defaults(func=cmd_build)
    p = sub.add_parser("patches", help="manage the numbered patch stack")
    p.add_argument("action", choices=["list", "check", "apply", "reverse", "refresh"])
    p.set_defaults(func=cmd_patches)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(open_workspace(), args)
    except (PinError, patches.PatchError, BuildError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
