"""`dgr worker`, `dgr generate`: a shard worker process, and generation through a route."""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from dgr_route.route import Draft, Route, RouteError, Sampling
from dgr_route.security import Security
from dgr_route.text import Detokenizer
from dgr_route.tokenizer import TokenizerError, TokenizerLike, tokenizer_for


def model_arg(value: str) -> Path:
    from dgr_artifacts.models import model_names, model_path

    return model_path(value) if value in model_names() else Path(value)


def worker_layers(args: argparse.Namespace, model: Path) -> tuple[str, list[str]]:
    """(--layers, the worker's descriptor arguments): with --recipe and --node, the node's range
    from a recipe checked against this model's manifest, whose fingerprint the worker reports
    (the model is hashed once); else --layers as given and the model's fingerprint."""
    from dgr_cli.workers import descriptor_args

    if args.recipe is None:
        if args.layers is None:
            raise ValueError("--layers FIRST:LAST is required (or --recipe FILE --node NAME)")
        return args.layers, descriptor_args(model)
    from dgr_artifacts.manifest import build_manifest
    from dgr_artifacts.recipe import load_recipe

    if args.node is None:
        raise ValueError("--recipe needs --node NAME: which of its stages this worker serves")
    recipe = load_recipe(args.recipe)
    manifest = build_manifest(model)
    recipe.check(manifest)
    layers = str(recipe.stage_of(args.node).layers)
    if args.layers is not None and args.layers != layers:
        raise ValueError(f"--layers {args.layers} is not node {args.node}'s {layers} in the recipe")
    return layers, ["--model-fingerprint", manifest.model_fingerprint, "--recipe-id", recipe.id]


def cmd_worker(args: argparse.Namespace) -> int:
    from dgr_artifacts.errors import ArtifactError
    from dgr_route.engine import EngineNotFound, locate
    from pydantic import ValidationError

    model = model_arg(args.model)
    try:
        layers, descriptor = worker_layers(args, model)
        worker = locate(args.lane)
    except (ValueError, ValidationError, OSError, EngineNotFound, ArtifactError) as exc:
        print(f"dgr worker: {exc}", file=sys.stderr)
        return 2
    cmd = [
        str(worker.worker),
        "--model",
        str(model),
        "--layers",
        layers,
        "--listen",
        args.listen,
        "--threads",
        str(args.threads),
        "--max-sessions",
        str(args.max_sessions),
        "--n-ctx",
        str(args.n_ctx),
        *descriptor,
        "--max-queue",
        str(args.max_queue),
        "--max-batch",
        str(args.max_batch),
        *[
            arg
            for flag, value in [
                ("--tls-cert", args.tls_cert),
                ("--tls-key", args.tls_key),
                ("--tls-client-ca", args.tls_client_ca),
                ("--auth-token-file", args.auth_token_file),
                ("--peer-ca", args.peer_ca),
                ("--metrics-listen", args.metrics_listen),
            ]
            if value
            for arg in (flag, str(value))
        ],
        *(["--gather-us", str(args.gather_us)] if args.gather_us is not None else []),
        *(
            ["--draft-part-rows", str(args.draft_part_rows)]
            if args.draft_part_rows is not None
            else []
        ),
        # 0 is a value here (the worker's default off the CPU lane is all layers)
        *(["--gpu-layers", str(args.gpu_layers)] if args.gpu_layers is not None else []),
        *(["--mtp"] if args.mtp else []),
        *(
            ["--max-data-streams", str(args.max_data_streams)]
            if args.max_data_streams is not None
            else []
        ),
        *(
            ["--prefix-cache-sessions", str(args.prefix_cache_sessions)]
            if args.prefix_cache_sessions is not None
            else []
        ),
        *(["--prefix-cache-bytes", args.prefix_cache_bytes] if args.prefix_cache_bytes else []),
        "--kernels",
        args.kernels,
        "--links",
        args.links,
    ]
    os.execv(cmd[0], cmd)  # the worker replaces this process: signals reach it directly


def open_client(args: argparse.Namespace) -> tuple[Route, TokenizerLike] | None:
    """The route the add_route_options arguments name and its tokenizer: --model's local
    vocabulary, else the head worker's over the wire. None after printing why either failed."""
    route = open_route(args)
    if route is None:
        return None
    try:
        return route, tokenizer_for(args.model and model_arg(args.model), route)
    except TokenizerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        route.close()
        return None


def cmd_generate(args: argparse.Namespace) -> int:
    client = open_client(args)
    if client is None:
        return 1
    route, tokenizer = client
    prompt = tokenizer.encode(args.prompt)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    started = time.perf_counter()
    try:
        count = stream_text(route, tokenizer, prompt, args.max_tokens, sampling, sys.stdout).tokens
    except RouteError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    finally:
        route.close()
    elapsed = time.perf_counter() - started
    print(flush=True)  # the text ends its line on standard output; figures go to standard error
    print(
        f"--- {count} tokens in {elapsed:.2f} s ({count / elapsed:.1f} tok/s) through "
        f"{len(route.stages)} stages",
        file=sys.stderr,
    )
    return 0


@dataclass
class Streamed:
    text: str  # what was written, end-of-generation not shown
    tokens: int  # generated, an end-of-generation token included
    why: str  # "stop", "length" or "interrupted"


def stream_text(
    route: Route,
    tokenizer: TokenizerLike,
    prompt: list[int],
    max_tokens: int,
    sampling: Sampling,
    out: TextIO,
    interruptible: bool = False,
) -> Streamed:
    """Write the generation's text to `out` as it comes (UTF-8 whole). With `interruptible`,
    Ctrl-C ends this generation (why: "interrupted") rather than the program; either way the
    route session ends with it."""
    detok = Detokenizer(tokenizer.detokenize)
    parts: list[str] = []

    def emit(text: str) -> None:
        parts.append(text)
        out.write(text)
        out.flush()

    count, why = 0, "length"
    results = route.generate(prompt, max_tokens, sampling, set(tokenizer.eog_ids))
    try:
        for token in results:
            count += 1
            if tokenizer.is_eog(token):
                why = "stop"
                break
            emit(detok.feed(token))
    except KeyboardInterrupt:
        if not interruptible:
            raise
        why = "interrupted"
    finally:
        results.close()  # ends the route session: every stage frees it
        emit(detok.flush())
    return Streamed("".join(parts), count, why)


def open_route(args: argparse.Namespace) -> Route | None:
    """The route the add_route_options arguments name, or None after printing why it failed."""
    try:
        return Route.open(
            args.route.split(","),
            timeout=args.timeout,
            wire_dtype=args.wire_dtype,
            mode=args.mode,
            security=Security.from_files(
                args.tls_ca, args.tls_cert, args.tls_key, args.auth_token_file
            ),
            draft=Draft(args.draft, max_draft=args.max_draft),
        )
    except (RouteError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def add_route_options(p: argparse.ArgumentParser) -> None:
    """--route, --timeout, --wire-dtype, --mode and the TLS/token options: how a client reaches and
    drives a route."""
    p.add_argument("--route", required=True, help="host:port,host:port,... in layer order")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a stage may take per step")
    p.add_argument(
        "--wire-dtype",
        choices=["f32", "f16", "bf16"],
        default="f32",
        help="the residual on the wire (f32: bitwise equal to one process; bf16 halves the bytes)",
    )
    p.add_argument(
        "--mode",
        choices=["forward", "relay"],
        default="forward",
        help="forward: stages stream to each other, the tail loops tokens back to the head "
        "(each token crosses each seam once); relay: every boundary passes through this client",
    )
    p.add_argument(
        "--draft",
        choices=["off", "lookup", "mtp"],
        default="off",
        help="speculative decoding (forward mode): lookup drafts from n-grams of the prompt and "
        "the text so far; mtp drafts with the model's MTP block at the tail (a tail started with "
        "--mtp). Drafts are verified through the route in one trip; output equals plain decode",
    )
    p.add_argument("--max-draft", type=int, default=8, help="drafts per step at most (1-16)")
    p.add_argument("--tls-ca", type=Path, help="PEM CA that signed the workers' certificates (TLS)")
    p.add_argument("--tls-cert", type=Path, help="PEM client certificate (workers requiring mTLS)")
    p.add_argument("--tls-key", type=Path, help="PEM key of the client certificate")
    p.add_argument("--auth-token-file", type=Path, help="file holding the workers' bearer token")


def register_worker(sub: Any) -> None:
    p = sub.add_parser("worker", help="serve one layer range of a model over gRPC")
    p.add_argument("--model", default="smollm2-135m-q4_1", help="GGUF path or registered name")
    p.add_argument("--layers", help="FIRST:LAST (half-open); or --recipe and --node")
    p.add_argument("--recipe", type=Path, help="a recipe (dgr plan --recipe-out), checked first")
    p.add_argument("--node", help="which of the recipe's stages this worker serves")
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-sessions", type=int, default=4)
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument(
        "--lane",
        help="the backend to compute on (cpu, vulkan, ...; default: the installed engine's); "
        "refused when no engine is built for it",
    )
    p.add_argument(
        "--gpu-layers",
        type=int,
        help="owned layers on the lane's device (-1: all; default: all off the CPU lane, else 0)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=16,
        help="forwards that may wait behind the one computing; more get RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=16,
        help="sessions' decode steps computed together in one llama_decode (1: FIFO turns)",
    )
    p.add_argument(
        "--gather-us",
        type=int,
        default=None,
        metavar="US",
        help="forward mode: how long a decode step that arrives with batch-mates from the stage "
        "before waits for the rest of them (default: the worker's own; 0: never waits)",
    )
    p.add_argument(
        "--draft-part-rows",
        type=int,
        default=None,
        metavar="N",
        help="the head, behind slow links: a drafted step of more rows goes in parts of about N "
        "rows that the stages pipeline (default: the worker's own, 2; 0: steps go whole)",
    )
    p.add_argument(
        "--mtp",
        action="store_true",
        help="the tail also serves the model's MTP (nextn) block and drafts with it (--draft mtp)",
    )
    p.add_argument(
        "--prefix-cache-sessions",
        type=int,
        default=None,
        metavar="N",
        help="prefix reuse: finished sessions whose KV the worker keeps, least recently used out "
        "first, in slots no live session needs (default: --max-sessions; 0: none kept)",
    )
    p.add_argument(
        "--prefix-cache-bytes",
        metavar="N[K|M|G]",
        help="prefix reuse: the most KV the kept sessions may hold (default: no bound but "
        "their number; the KV buffer is allocated whole at start, so keeping never grows memory)",
    )
    p.add_argument(
        "--kernels",
        choices=("invariant", "stock"),
        default="invariant",
        help="invariant (default): a sequence's values do not depend on the batch it computes "
        "in (batched decode equals solo decode, a reused prefix equals a full prefill, bit for "
        "bit); stock: ggml's batch-shaped kernels",
    )
    p.add_argument(
        "--links",
        choices=("data", "grpc"),
        default="data",
        help="forward mode's links to plaintext peers: framed TCP streams on the workers' own "
        "ports (data, the default) or gRPC calls (TLS peers always use gRPC)",
    )
    p.add_argument(
        "--max-data-streams",
        type=int,
        default=None,
        metavar="N",
        help="data streams the worker serves at once; past it a stream is refused "
        "(default: 4 per session slot + 16)",
    )
    p.add_argument("--tls-cert", type=Path, help="PEM server certificate (serve TLS)")
    p.add_argument("--tls-key", type=Path, help="PEM key of the server certificate")
    p.add_argument(
        "--tls-client-ca", type=Path, help="PEM CA clients' certificates must chain to (mTLS)"
    )
    p.add_argument("--auth-token-file", type=Path, help="require this bearer token on every call")
    p.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus metrics at /metrics and a JSON view at /metrics.json",
    )
    p.add_argument(
        "--peer-ca",
        type=Path,
        help="PEM CA that signed the other workers' certificates (default: --tls-client-ca, else "
        "the system's trust store); a worker with --tls-cert reaches its next stage and the head "
        "over TLS only, with its own certificate and token",
    )
    p.set_defaults(func=cmd_worker)


def register_generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate through a route of running workers")
    p.add_argument("prompt")
    add_route_options(p)
    p.add_argument("--model", help="a local GGUF for the tokenizer (default: the head worker's)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_generate)
