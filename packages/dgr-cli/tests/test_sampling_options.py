"""`dgr generate` and `dgr chat` check their sampling options (dgr_route.route.Sampling's ranges)
before they open the route: an error that names the option, exit 2, and no connection made."""

from __future__ import annotations

import pytest
from dgr_cli import main


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_the_cli_refuses_a_bad_option_before_it_connects(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [command, "--route", "127.0.0.1:9", "--top-k", "-3"]
    argv += ["hi"] if command == "generate" else []
    assert main(argv) == 2  # port 9 (discard) is never dialled: the check comes first
    assert (
        "error: sampling top_k must be an integer in [0, 2**32), not -3" in capsys.readouterr().err
    )
