"""The `dgr` commands check their options before they connect or bind anything: sampling
(dgr_route.route.Sampling's ranges), ports, counts, seconds, addresses, model names. An error
that names the option, exit 2, and no connection made."""

from __future__ import annotations

from pathlib import Path

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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--port", "99999"], "argument --port: '99999' is not an integer in [1, 65535]"),
        (["serve", "--max-active", "0"], "argument --max-active: '0' is not an integer in [1,"),
        (["serve", "--max-queue", "-1"], "argument --max-queue: '-1' is not an integer in [0,"),
        (["generate", "hi", "--max-tokens", "0"], "argument --max-tokens: '0' is not an integer"),
        (["chat", "--max-tokens", "x"], "argument --max-tokens: 'x' is not an integer in [1,"),
        (["generate", "hi", "--timeout", "nan"], "argument --timeout: 'nan' is not a finite"),
        (["chat", "--timeout", "-1"], "argument --timeout: '-1' is not a finite number of seconds"),
        (["generate", "hi", "--max-draft", "17"], "argument --max-draft: '17' is not an integer"),
    ],
)
def test_an_option_out_of_its_range_is_a_usage_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused by the parser (exit 2), before a route is opened or a port bound: `dgr serve
    --port 99999` was a traceback from bind(), --max-active 0 meant the default and --max-queue
    -1 started a server."""
    with pytest.raises(SystemExit) as done:
        main([*argv, "--route", "127.0.0.1:9"])
    assert done.value.code == 2
    assert message in capsys.readouterr().err


def test_health_and_demo_name_what_is_wrong(capsys: pytest.CaptureFixture[str]) -> None:
    """`dgr health 127.0.0.1:99999` dialled port 34463 (gRPC's modulo); `dgr demo --model nope`
    was a KeyError traceback."""
    assert main(["health", "127.0.0.1:99999"]) == 2
    assert "dgr health: stage 0: address '127.0.0.1:99999' is not HOST:PORT" in (
        capsys.readouterr().err
    )
    assert main(["demo", "--model", "nope"]) == 2
    err = capsys.readouterr().err
    assert "dgr demo: unknown model 'nope': known are " in err and "smollm2-135m-q4_1" in err


def test_demo_refuses_counts_it_cannot_run(capfd: pytest.CaptureFixture[str]) -> None:
    """--stages 0 was a ZeroDivisionError, --stages 99 a traceback from the 31st worker's
    refusal of [0, 0), --max-tokens -3 a ValueError: now usage errors before any worker starts."""
    for argv, message in [
        (["--stages", "0"], "argument --stages: '0' is not an integer in [1, 256]"),
        (["--max-tokens", "-3"], "argument --max-tokens: '-3' is not an integer in [1,"),
    ]:
        with pytest.raises(SystemExit) as done:
            main(["demo", *argv])
        assert done.value.code == 2 and message in capfd.readouterr().err
    assert main(["demo", "--stages", "31"]) == 2  # the model has 30 layers: one each at most
    assert "dgr demo: --stages 31 is more than the model's 30 layers" in capfd.readouterr().err
    # an empty prompt was a ValueError traceback after three workers had started
    assert main(["demo", "--prompt", ""]) == 2
    assert "dgr demo: --prompt encodes to no tokens: the demo takes 1 to 1023" in (
        capfd.readouterr().err
    )


@pytest.mark.fleet
def test_a_demo_of_one_token_times_no_decode(capfd: pytest.CaptureFixture[str]) -> None:
    """--max-tokens 1 divided 0 decode tokens/s by 0: decode from the first token on times none."""
    assert main(["demo", "--stages", "1", "--max-tokens", "1"]) == 0
    out = capfd.readouterr().out
    assert "decode not timed (one token) over 1 worker process (forward mode)" in out, out
    assert "route/single" not in out and "parity: 1 greedy tokens identical" in out, out


@pytest.mark.parametrize(
    ("option", "content", "message"),
    [
        ("--tls-ca", None, "error: the TLS CA {path}: No such file or directory"),
        ("--tls-ca", b"", "error: the TLS CA {path}: the file is empty"),
        ("--tls-ca", b"garbage\n", "error: the TLS CA {path}: not PEM (no -----BEGIN line)"),
        ("--auth-token-file", b"\xff\xfe", "error: the bearer token file {path}: not UTF-8 text"),
    ],
)
def test_a_credential_file_that_cannot_serve_is_named_before_connecting(
    option: str,
    content: bytes | None,
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A missing --tls-ca was a FileNotFoundError traceback; one that is not PEM reached gRPC,
    which said only "Failed to create security handshaker" on the first call."""
    path = tmp_path / "file"
    if content is not None:
        path.write_bytes(content)
    assert main(["generate", "--route", "127.0.0.1:9", option, str(path), "hi"]) == 1
    assert capsys.readouterr().err == message.format(path=path) + "\n"
