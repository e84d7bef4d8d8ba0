"""`dgr worker`, `dgr generate`: a shard worker process, and generation through a route."""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
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
    from dgr_artifacts.manifest import stored_manifest
    from dgr_artifacts.recipe import load_recipe

    if args.node is None:
        raise ValueError("--recipe needs --node NAME: which of its stages this worker serves")
    recipe = load_recipe(args.recipe)
    manifest = stored_manifest(model)
    recipe.check(manifest)
    layers = str(recipe.stage_of(args.node).layers)
    if args.layers is not None and args.layers != layers:
        raise ValueError(f"--layers {args.layers} is not node {args.node}'s {layers} in the recipe")
    return layers, ["--model-fingerprint", manifest.model_fingerprint, "--recipe-id", recipe.id]


def cmd_worker(args: argparse.Namespace) -> int:
    from dgr_artifacts.errors import ArtifactError, problems
    from dgr_route.engine import EngineNotFound, locate
    from pydantic import ValidationError

    rest: list[str] = args.unknown
    if os.environ.get("DGR_NO_WORKERS") and "--check-args" not in rest and not args.help:
        print("dgr worker: DGR_NO_WORKERS is set (the fast test tier)", file=sys.stderr)
        return 2
    try:
        worker = locate(args.lane)
    except EngineNotFound as exc:
        print(f"dgr worker: {exc}", file=sys.stderr)
        return 2
    if args.help:
        print(args.parser.format_help())
        print("dgr-shard-worker's options, passed on as given:", flush=True)
        return subprocess.call([str(worker.worker), "--help"])
    model = model_arg(args.model)
    try:
        layers, descriptor = worker_layers(args, model)
    except ValidationError as exc:
        print(f"dgr worker: {problems(exc)}", file=sys.stderr)
        return 2
    except (ValueError, OSError, ArtifactError) as exc:
        print(f"dgr worker: {exc}", file=sys.stderr)
        return 2
    cmd = [str(worker.worker), "--model", str(model), "--layers", layers, *descriptor, *rest]
    os.execv(cmd[0], cmd)  # the worker replaces this process: signals reach it directly


def open_client(args: argparse.Namespace) -> tuple[Route, TokenizerLike] | None:
    """The route the add_route_options arguments name and its tokenizer: --model's local
    vocabulary, else the head worker's over the wire. None after printing why either failed."""
    route = open_route(args)
    if route is None:
        return None
    if not route.stages[0].describe.compatibility.model_fingerprint:
        # Route.open checks every stage reports the head's fingerprint: an empty one matches
        print(
            "note: the route's workers report no model fingerprint (bare dgr-shard-worker "
            "without --model-fingerprint; dgr worker gives it), so that every stage serves the "
            "same model is not checked",
            file=sys.stderr,
        )
    local = args.model and model_arg(args.model)
    if local and (why := not_the_routes_model(local, route)):
        print(f"error: {why}", file=sys.stderr)
        route.close()
        return None
    try:
        return route, tokenizer_for(local, route)
    except TokenizerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        route.close()
        return None


def not_the_routes_model(model: Path, route: Route) -> str | None:
    """Why a local GGUF's vocabulary cannot stand for the route's (no GGUF, or another model:
    every prompt would be tokenized wrong, silently), or None. A head started without the
    fingerprint (a bare dgr-shard-worker) cannot be checked against."""
    from dgr_artifacts.errors import ArtifactError
    from dgr_artifacts.identity import stored_fingerprint

    try:
        got = stored_fingerprint(model)
    except (ArtifactError, OSError) as exc:
        return f"--model: {exc}"
    head = route.stages[0]
    want = head.describe.compatibility.model_fingerprint
    if not want or got == want:
        return None
    return (
        f"--model {model} is not the route's model: its fingerprint is {got[:16]}, the head "
        f"({head.address}) serves {want[:16]}"
    )


def sampling_of(args: argparse.Namespace) -> Sampling | None:
    """The sampling options as the route takes them; None (said on standard error) if one is
    out of its range."""
    try:
        return Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def cmd_generate(args: argparse.Namespace) -> int:
    sampling = sampling_of(args)
    if sampling is None:
        return 2
    client = open_client(args)
    if client is None:
        return 1
    route, tokenizer = client
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        print("error: the prompt is empty: it encodes to no tokens", file=sys.stderr)
        route.close()
        return 2
    started = time.perf_counter()
    try:
        streamed = stream_text(route, tokenizer, prompt, args.max_tokens, sampling, sys.stdout)
    except RouteError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    finally:
        route.close()
    elapsed = time.perf_counter() - started
    count = streamed.tokens
    # a generation ends where the route's context does, short of --max-tokens: say so
    full = streamed.why == "length" and count < args.max_tokens
    print(flush=True)  # the text ends its line on standard output; figures go to standard error
    print(
        f"--- {count} tokens in {elapsed:.2f} s ({count / elapsed:.1f} tok/s) through "
        f"{counted(len(route.stages), 'stage')}"
        + (f"; stopped at the route's context of {route.n_ctx} tokens" if full else ""),
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


def counted(n: int, one: str, many: str | None = None) -> str:
    """`n` and the noun for it: "1 stage", "3 stages", "1 worker process"."""
    return f"{n} {one if n == 1 else many or one + 's'}"


def integer(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi], or the option's error saying so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = lo - 1
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer in [{lo}, {hi}]")
        return value

    parse.__name__ = "integer"
    return parse


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of seconds > 0")
    return value


MAX_TOKENS = integer(1, 2**31 - 1)


def add_route_options(p: argparse.ArgumentParser) -> None:
    """--route, --timeout, --wire-dtype, --mode and the TLS/token options: how a client reaches and
    drives a route."""
    p.add_argument("--route", required=True, help="host:port,host:port,... in layer order")
    p.add_argument(
        "--timeout", type=seconds, default=60.0, help="seconds a stage may take per step"
    )
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
    p.add_argument(
        "--max-draft", type=integer(1, 16), default=8, help="drafts per step at most (1-16)"
    )
    p.add_argument("--tls-ca", type=Path, help="PEM CA that signed the workers' certificates (TLS)")
    p.add_argument("--tls-cert", type=Path, help="PEM client certificate (workers requiring mTLS)")
    p.add_argument("--tls-key", type=Path, help="PEM key of the client certificate")
    p.add_argument("--auth-token-file", type=Path, help="file holding the workers' bearer token")


def register_worker(sub: Any) -> None:
    p = sub.add_parser(
        "worker",
        help="serve one layer range of a model over gRPC",
        description="Start dgr-shard-worker on a layer range of a model. dgr resolves the options "
        "below (a registered model's name, a recipe's node, the lane's build) and passes every "
        "other option to the worker as given: the worker's own table (`dgr worker --help` lists "
        "it after these) is the only one. --check-args prints the options as resolved and exits.",
        add_help=False,
        allow_abbrev=False,
    )
    p.add_argument("-h", "--help", action="store_true", help="this help, then the worker's options")
    p.add_argument("--model", default="smollm2-135m-q4_1", help="GGUF path or registered name")
    p.add_argument("--layers", help="FIRST:LAST (half-open); or --recipe and --node")
    p.add_argument("--recipe", type=Path, help="a recipe (dgr plan --recipe-out), checked first")
    p.add_argument("--node", help="which of the recipe's stages this worker serves")
    p.add_argument(
        "--lane",
        help="the backend to compute on (cpu, vulkan, ...; default: the installed engine's); "
        "refused when no engine is built for it",
    )
    p.set_defaults(func=cmd_worker, forwards_unknown=True, parser=p)


def register_generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate through a route of running workers")
    p.add_argument("prompt")
    add_route_options(p)
    p.add_argument("--model", help="a local GGUF for the tokenizer (default: the head worker's)")
    p.add_argument("--max-tokens", type=MAX_TOKENS, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_generate)
