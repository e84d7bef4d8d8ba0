"""`dgr chat`: an interactive conversation over a route, in the model's own chat template.

Each turn sends the whole conversation (a route session per turn) and streams the reply as it
is generated; the stages keep the conversation's KV between turns (prefix reuse: the route asks
them to start from what the last turn left, and a turn prefills only its new message, the same
bits as a full prefill), so the next reply starts about as soon as the first did. Ctrl-C
during a reply stops that reply (the route's session is closed, the stages free it) and keeps
the conversation with what was said so far; Ctrl-C at the prompt clears the line; Ctrl-D or
/exit leaves; /reset starts over.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from dgr_route.route import RouteError
from dgr_route.tokenizer import TokenizerLike

from dgr_cli.commands import (
    MAX_TOKENS,
    add_route_options,
    counted,
    open_client,
    sampling_of,
    stream_text,
)

PROMPT = "> "


class Conversation:
    """The messages so far, and the prompt that fits the route's context."""

    def __init__(self, tokenizer: TokenizerLike, n_ctx: int, system: str | None) -> None:
        self.tokenizer, self.n_ctx = tokenizer, n_ctx
        self.system = [("system", system)] if system else []
        self.turns: list[tuple[str, str]] = []

    def prompt(self, reserve: int) -> tuple[list[int], int]:
        """The conversation's tokens, oldest turns dropped until `reserve` tokens of room remain
        (as many as fit when even the last message alone leaves less); and how many dropped."""
        dropped = 0
        while True:
            tokens = self.tokenizer.encode(self.tokenizer.chat(self.system + self.turns))
            if len(tokens) + reserve <= self.n_ctx or len(self.turns) <= 1:
                return tokens, dropped
            self.turns.pop(0)
            dropped += 1


COMMAND = re.compile(r"/[A-Za-z]+")  # /reset, /exit, /quit and the ones that do not exist


def cmd_chat(args: argparse.Namespace) -> int:
    sampling = sampling_of(args)
    if sampling is None:
        return 2
    client = open_client(args)
    if client is None:
        return 1
    route, tokenizer = client
    n_ctx = route.n_ctx
    conversation = Conversation(tokenizer, n_ctx, args.system)
    out = sys.stdout
    print(
        f"dgr chat: {counted(len(route.stages), 'stage')}, context {n_ctx} tokens. "
        "Ctrl-C stops a reply, Ctrl-D or /exit leaves, /reset starts over.",
        file=sys.stderr,
    )
    try:
        while True:
            try:
                line = input(PROMPT)
            except KeyboardInterrupt:
                print(file=out)
                continue
            except EOFError:
                print(file=out)
                return 0
            if line.strip() in ("/exit", "/quit"):
                return 0
            if line.strip() == "/reset":
                conversation.turns.clear()
                print("(conversation cleared)", file=sys.stderr)
                continue
            if COMMAND.fullmatch(line.strip()):  # a lone /word: a command mistyped, not a message
                print(
                    f"(no command {line.strip()}: /reset starts over, /exit leaves)",
                    file=sys.stderr,
                )
                continue
            if not line.strip():
                continue
            conversation.turns.append(("user", line))
            prompt, dropped = conversation.prompt(min(args.max_tokens, n_ctx // 2))
            if dropped:
                print(
                    f"(dropped the {dropped} oldest messages to fit the context)", file=sys.stderr
                )
            room = n_ctx - len(prompt)
            if room < 1:
                print(
                    f"error: the message alone is {len(prompt)} tokens (in the chat template), "
                    f"over the route's context of {n_ctx}: not sent",
                    file=sys.stderr,
                )
                conversation.turns.pop()
                continue
            try:
                streamed = stream_text(
                    route, tokenizer, prompt, min(args.max_tokens, room), sampling, out, True
                )
            except RouteError as exc:
                print(f"\nerror: {exc}", file=sys.stderr)
                conversation.turns.pop()
                continue
            conversation.turns.append(("assistant", streamed.text))
            print(file=out)
            if streamed.why == "interrupted":
                print("(reply stopped)", file=sys.stderr)
            elif streamed.why == "length":
                print("(reply cut at max tokens)", file=sys.stderr)
    finally:
        route.close()


def register(sub: Any) -> None:
    p = sub.add_parser("chat", help="interactive chat over a route, in the model's template")
    add_route_options(p)
    p.add_argument(
        "--model", help="a local GGUF for the tokenizer and template (default: the head worker's)"
    )
    p.add_argument("--system", help="a system message opening the conversation")
    p.add_argument("--max-tokens", type=MAX_TOKENS, default=512, help="the longest reply")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_chat)
