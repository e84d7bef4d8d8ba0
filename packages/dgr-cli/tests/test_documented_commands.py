"""Every `dgr` command line the documentation shows (README.md and docs/, fenced blocks and
inline code) parses with the `dgr` command's own parser, as `dgr` would parse it before running:
a documented subcommand or option that does not exist, or a value it refuses, fails here. Inline
code names a command or an option in prose, not a whole command line: there, only the arguments
it leaves out may be missing.
(`dgr worker` lines are checked against the worker's option table in test_worker_options.py.)"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
from dgr_cli import build_parser

ROOT = Path(__file__).resolve().parents[3]
COMMAND = re.compile(r"(?:uv run )?dgr (?!worker\b)[a-z][^`\n]*")


def documented() -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
        prose = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S).replace("\n", " ")
        lines = [
            line.strip() for block in blocks for line in block.replace("\\\n", " ").splitlines()
        ]
        spans = [s.strip() for s in re.findall(r"`([^`]+)`", prose)]
        for where, candidates in (
            (f"{path.name} (block)", lines),
            (f"{path.name} (inline)", spans),
        ):
            for text_ in candidates:
                # a command substitution's command is one of its own; the outer sees a value
                inner = re.findall(r"\$\((dgr [^)]*)\)", text_)
                text_ = " ; ".join([re.sub(r"\$\([^)]*\)", "VALUE", text_), *inner])
                for m in COMMAND.finditer(text_):
                    if m.start() == 0 or text_[m.start() - 1] in " ($;&|":
                        found.append((where, m.group(0)))
    return found


COMMANDS = documented()


def words(line: str) -> list[str]:
    """The command's arguments: a comment, a trailing `&` and what a pipe or `;` starts cut off,
    `...` (options left out) dropped, shell variables and command substitutions as values."""
    line = line.split(" #", 1)[0]
    line = re.split(r"\s(?:\||;|&&|>)\s?", line, maxsplit=1)[0].rstrip(" &")
    out = shlex.split(line.removeprefix("uv run "))[1:]
    return [w for w in out if w != "..."]


def test_the_docs_show_dgr_commands() -> None:
    # the README's quick start and install block at least (so the test below reads something)
    subcommands = {words(line)[0] for _, line in COMMANDS}
    assert {"demo", "generate", "serve", "artifacts", "plan", "bench"} <= subcommands


@pytest.mark.parametrize(("where", "line"), COMMANDS, ids=[f"{w}: {c}" for w, c in COMMANDS])
def test_documented_dgr_command_parses(where: str, line: str) -> None:
    parser = build_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args, unknown = parser.parse_known_args(words(line))
    except SystemExit as exc:
        if exc.code == 0:  # --help or --version: parsed, and printed
            return
        message = err.getvalue().strip().splitlines()[-1]
        if where.endswith("(inline)") and "the following arguments are required" in message:
            return
        pytest.fail(f"{where}: `{line}` does not parse: {message}")
    assert isinstance(args, argparse.Namespace)
    assert not unknown or getattr(args, "forwards_unknown", False), f"{where}: {unknown}"


def test_the_check_refuses_a_wrong_option_and_subcommand() -> None:
    for line in ("dgr generate --route 127.0.0.1:1 --tokens-max 3 hi", "dgr generat --route x"):
        with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            build_parser().parse_args(words(line))
