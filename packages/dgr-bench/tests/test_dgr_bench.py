"""`dgr bench`: routes of local workers timed against the engine in one process, as a user runs
it (the `dgr` command, real workers on loopback), and its refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DGR = str(Path(sys.executable).parent / "dgr")


def dgr(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DGR, *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--decode-tokens", "0"], "--decode-tokens must be at least 1, not 0"),
        (["--rounds", "-1"], "--rounds must be at least 1"),
        (["--stages", "0"], "--stages and --threads take positive counts"),
        (["--model", "/nonexistent.gguf"], "no model at /nonexistent.gguf"),
        # refused before any timing: it timed the engine, skipped the row and exited 0
        (["--stages", "3", "31"], "--stages 31 is more than the model's 30 layers"),
    ],
)
def test_refuses_what_it_cannot_time(args: list[str], message: str) -> None:
    done = dgr("bench", *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.fleet  # dgr bench starts its workers
def test_times_a_route_against_the_engine(smollm2: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = dgr(
        "bench", "--model", str(smollm2), "--stages", "1", "2", "--threads", "1",
        "--prompt-tokens", "24", "--decode-tokens", "6", "--rounds", "1", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    one = result["by_threads"]["1"]
    assert list(one["rows"]) == [
        "engine in one process",
        "DGR forward 1 stage",
        "DGR forward 2 stages",
    ]
    for name, row in one["rows"].items():
        assert row["decode"] > 0 and row["prefill"] > 0
        # the ratios are the rows' own, against the engine's row
        ratio = row["decode"] / one["rows"]["engine in one process"]["decode"]
        assert one["decode_over_engine"][name] == pytest.approx(ratio)
        assert f"{name:<26}" in done.stdout
    assert one["decode_over_engine"]["engine in one process"] == 1.0
    assert result["host"]["cpu"]["cores"] >= 1 and result["decode_tokens"] == 6
