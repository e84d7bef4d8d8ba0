"""`dgr chat` in a real terminal (tmux) over real workers: a reply streams, Ctrl-C stops a reply
and frees the route's session without ending the conversation, Ctrl-D leaves."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from dgr_cli.workers import WorkerProcess, descriptor_args, start_worker


@pytest.fixture(scope="module")
def workers(smollm2: Path) -> Iterator[list[WorkerProcess]]:
    descriptor = descriptor_args(smollm2)
    started = [
        start_worker(smollm2, a, b, descriptor=descriptor, n_ctx=1024)
        for a, b in [(0, 15), (15, 30)]
    ]
    yield started
    for w in started:
        w.stop()


class Terminal:
    def __init__(self, name: str, command: list[str]) -> None:
        self.name = name
        subprocess.run(
            ["tmux", "new-session", "-d", "-s", name, "-x", "160", "-y", "60", *command],
            check=True,
        )
        subprocess.run(["tmux", "set-option", "-t", name, "remain-on-exit", "on"], check=True)

    def screen(self) -> str:
        return subprocess.run(
            ["tmux", "capture-pane", "-p", "-J", "-t", self.name, "-S", "-500"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def wait(self, until: Callable[[str], bool], timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if until(screen):
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"terminal did not get there in {timeout} s:\n{screen}")
            time.sleep(0.1)

    def dead(self) -> bool:
        out = subprocess.run(
            ["tmux", "list-panes", "-t", self.name, "-F", "#{pane_dead}"],
            capture_output=True,
            text=True,
        ).stdout
        return out.strip() == "1"

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def prompts(screen: str) -> int:
    return sum(1 for line in screen.splitlines() if line.startswith("> "))


def test_chat_in_a_terminal(workers: list[WorkerProcess]) -> None:
    dgr = str(Path(sys.executable).with_name("dgr"))
    route = ",".join(w.address for w in workers)
    term = Terminal(f"dgr-chat-test-{time.monotonic_ns()}", [dgr, "chat", "--route", route])
    try:
        term.wait(lambda s: "dgr chat: 2 stages" in s and s.rstrip().endswith(">"))
        term.keys("What is the capital of France?", "Enter")
        screen = term.wait(lambda s: prompts(s) >= 2 and s.rstrip().endswith(">"))
        assert "Paris" in screen.split("What is the capital of France?")[1]

        term.keys("Tell me a very long story about a dragon and a knight.", "Enter")
        term.wait(lambda s: len(s.split("dragon and a knight.")[-1].strip()) > 20)
        term.keys("C-c")
        screen = term.wait(lambda s: "(reply stopped)" in s and s.rstrip().endswith(">"))
        assert not term.dead()
        # the interrupted reply closed its route session on every stage
        deadline = time.monotonic() + 10
        while any(w.sessions() for w in workers):
            assert time.monotonic() < deadline, [w.sessions() for w in workers]
            time.sleep(0.1)

        term.keys("/rest", "Enter")  # a mistyped command is said to be one, not sent
        term.wait(lambda s: "(no command /rest: /reset starts over, /exit leaves)" in s)
        term.keys("cat " * 1100, "Enter")  # past the context alone: said, not sent, not kept
        term.wait(lambda s: "over the route's context of 1024: not sent" in s)
        term.keys("Thank you!", "Enter")  # the conversation goes on
        term.wait(lambda s: prompts(s) >= 6 and s.rstrip().endswith(">"))
        term.keys("C-d")
        deadline = time.monotonic() + 10
        while not term.dead():
            assert time.monotonic() < deadline, term.screen()
            time.sleep(0.1)
    finally:
        term.close()
