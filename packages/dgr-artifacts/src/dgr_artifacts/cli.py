"""`dgr artifacts inspect|manifest|verify|provision|subset|fetch-model`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dgr_artifacts.errors import ArtifactError
from dgr_artifacts.identity import fingerprint, open_model
from dgr_artifacts.manifest import DEFAULT_CHUNK, build_manifest, load_manifest, write_manifest
from dgr_artifacts.models import model_names, model_path
from dgr_artifacts.progress import Progress
from dgr_artifacts.provision import StoragePolicy, provision
from dgr_artifacts.subset import range_subset
from dgr_artifacts.verify import verify


def layer_range(text: str) -> tuple[int, int]:
    """argparse type for FIRST:LAST (half-open)."""
    first, sep, last = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(first), int(last)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not FIRST:LAST, e.g. 10:20") from None


def chunk_size(text: str) -> int:
    """argparse type for --chunk-size: a whole number of bytes, at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of bytes >= 1")
    return value


def cmd_inspect(args: argparse.Namespace) -> int:
    model = open_model(args.gguf)
    info: dict[str, Any] = {
        "arch": model.arch,
        "n_layer": model.n_layer,
        "files": [str(p.path) for p in model.parts],
        "gguf_version": model.parts[0].version,
        "hparams": model.hparams(),
        "tensor_count": len(model.tensors),
    }
    if args.fingerprint:
        info["fingerprint"] = fingerprint(model)
    if args.tensors:
        info["tensors"] = [
            [t.name, t.dtype, list(t.shape), t.file, t.offset, t.nbytes] for t in model.tensors
        ]
    print(json.dumps(info, indent=2, default=str))
    return 0


def cmd_manifest(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if not out.parent.is_dir():
        raise ArtifactError(out, "its directory does not exist")
    manifest = build_manifest(Path(args.gguf), args.chunk_size)
    write_manifest(manifest, out)
    print(
        f"manifest of {len(manifest.files)} file(s), {len(manifest.tensors)} tensors, "
        f"fingerprint {manifest.model_fingerprint} -> {args.out}"
    )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    manifest = load_manifest(Path(args.manifest))
    total = sum(f.size for f in manifest.files)
    result = verify(
        manifest,
        Path(args.model_dir),
        Path(args.state_dir) if args.state_dir else None,
        Progress("verify", total),
        fresh=args.fresh,
    )
    for problem in [*result.problems, *map(str, result.bad)]:
        print(f"BAD {problem}")
    print("verified: all chunks match the manifest" if result.ok else "verification FAILED")
    return 0 if result.ok else 1


def cmd_provision(args: argparse.Namespace) -> int:
    manifest = load_manifest(Path(args.manifest))
    forbidden = tuple(Path(p) for p in ["/home", *args.forbid])
    only = None
    if args.layers:
        only = range_subset(manifest, *args.layers).files
    total = sum(f.size for f in manifest.files if only is None or f.name in only)
    result = provision(
        manifest,
        args.source,
        StoragePolicy(Path(args.root), forbidden),
        only,
        Progress("provision", total),
    )
    print(
        f"kept {len(result.kept)}, fetched {len(result.fetched)} file(s); "
        f"{result.bytes_copied} bytes copied, {result.resumed_bytes} resumed"
    )
    return 0


def cmd_subset(args: argparse.Namespace) -> int:
    manifest = load_manifest(Path(args.manifest))
    first, last = args.layers
    sub = range_subset(manifest, first, last)
    print(
        json.dumps(
            {
                "layers": [first, last],
                "files": sub.bytes_per_file,
                "total_bytes": sub.total_bytes,
                "tensors": [t.name for t in sub.tensors],
            },
            indent=2,
        )
    )
    return 0


def cmd_fetch_model(args: argparse.Namespace) -> int:
    print(model_path(args.name))
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        code: int = args.artifacts_func(args)
    except (ArtifactError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return code


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "artifacts", help="GGUF identity, manifests, verification, provisioning, range subsets"
    )
    parser.set_defaults(func=run)
    cmds = parser.add_subparsers(dest="artifacts_command", required=True)
    p = cmds.add_parser("inspect", help="arch, hyperparameters, tensor table, fingerprint")
    p.add_argument("gguf")
    p.add_argument("--tensors", action="store_true")
    p.add_argument("--fingerprint", action="store_true")
    p.set_defaults(artifacts_func=cmd_inspect)
    p = cmds.add_parser("manifest", help="write the hashed manifest of a (split) model")
    p.add_argument("gguf")
    p.add_argument("--out", required=True)
    p.add_argument("--chunk-size", type=chunk_size, default=DEFAULT_CHUNK)
    p.set_defaults(artifacts_func=cmd_manifest)
    p = cmds.add_parser("verify", help="resumable chunked verification against a manifest")
    p.add_argument("manifest")
    p.add_argument("model_dir")
    p.add_argument("--state-dir")
    p.add_argument("--fresh", action="store_true", help="ignore saved progress")
    p.set_defaults(artifacts_func=cmd_verify)
    p = cmds.add_parser("provision", help="copy into a storage root, verified and atomic")
    p.add_argument("manifest")
    p.add_argument("--source", required=True, help="directory, file:// or http(s):// URL")
    p.add_argument("--root", required=True)
    p.add_argument("--forbid", action="append", default=[], help="another forbidden prefix")
    p.add_argument(
        "--layers", type=layer_range, help="first:last, provision only what the range needs"
    )
    p.set_defaults(artifacts_func=cmd_provision)
    p = cmds.add_parser("subset", help="tensors, files and bytes a layer range needs")
    p.add_argument("manifest")
    p.add_argument("--layers", type=layer_range, required=True, help="first:last (half-open)")
    p.set_defaults(artifacts_func=cmd_subset)
    p = cmds.add_parser(
        "fetch-model", help="fetch a registered real model from the index (or generate a twin)"
    )
    p.add_argument("name", nargs="?", default="smollm2-135m-q4_1", choices=model_names())
    p.set_defaults(artifacts_func=cmd_fetch_model)


def main(argv: list[str] | None = None) -> int:
    """`python -m dgr_artifacts.cli ...`, the same as `dgr artifacts ...`."""
    parser = argparse.ArgumentParser(prog="dgr")
    register(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["artifacts", *(argv if argv is not None else sys.argv[1:])]))


if __name__ == "__main__":
    sys.exit(main())
