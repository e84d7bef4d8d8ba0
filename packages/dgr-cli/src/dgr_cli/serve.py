"""`dgr serve`: the OpenAI-compatible HTTP server over a route of running workers."""

from __future__ import annotations

import argparse
import re
import socket
import sys
from typing import Any

from dgr_route.route import Route

from dgr_cli.commands import add_route_options, counted, integer, model_arg, open_client


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP API over a route")
    add_route_options(p)
    p.add_argument(
        "--model", help="a local GGUF for the tokenizer and template (default: the head worker's)"
    )
    p.add_argument("--model-name", help="the id /v1/models reports")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=integer(1, 65535), default=8000)
    p.add_argument(
        "--max-active",
        type=integer(1, 65536),
        help="requests generating at once (default: the route's session slots)",
    )
    p.add_argument(
        "--max-queue",
        type=integer(0, 2**20),
        default=16,
        help="requests that may wait; more get HTTP 429",
    )
    p.set_defaults(func=cmd_serve)


def served_name(route: Route) -> str:
    """The model id /v1/models reports without --model-name or --model: the head worker's GGUF
    file name less .gguf (Describe.model_name, what `dgr artifacts fetch-model` names it), else
    the arch and the fingerprint's start (a worker older than that field), else the arch."""
    head = route.stages[0].describe
    if re.fullmatch(r"[ -~]{1,128}", head.model_name):
        return head.model_name
    c = head.compatibility
    return f"{c.arch}-{c.model_fingerprint[:12]}" if c.model_fingerprint else c.arch


def bound(host: str, port: int) -> socket.socket:
    """A listening socket at host:port, bound here so that a port in use or a host that is not
    this machine's is said before serving (uvicorn logged it and exited 3), and so that the
    address printed is one that is listening."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn
    from dgr_serve.openai_server import create_app

    client = open_client(args)
    if client is None:
        return 1
    route, tokenizer = client
    try:
        sock = bound(args.host, args.port)
    except OSError as exc:
        print(f"dgr serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        route.close()
        return 2
    name = args.model_name or (model_arg(args.model).stem if args.model else served_name(route))
    app = create_app(route, tokenizer, name, max_active=args.max_active, max_queue=args.max_queue)
    active = app.state.admission.limit
    print(
        f"dgr serve: http://{args.host}:{args.port}/v1 serves {name} over "
        f"{counted(len(route.stages), 'stage')}: {active} request(s) at once, "
        f"{args.max_queue} queued",
        file=sys.stderr,
        flush=True,
    )
    if active > route.slots:
        print(
            f"dgr serve: note: --max-active {active} is more than the route's {route.slots} "
            "session slots: requests past them are answered 429 by the stages' capacity",
            file=sys.stderr,
            flush=True,
        )
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])
    return 0
