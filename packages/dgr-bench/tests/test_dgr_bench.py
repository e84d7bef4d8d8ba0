"""`dgr bench`: routes of local workers timed against the engine in one process, as a user runs
it (the `dgr` command, real workers on loopback), and its refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DGR = str(Path(sys.executable).parent / "dgr")
CORES = len(os.sched_getaffinity(0))


def dgr(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DGR, *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--decode-tokens", "0"], "argument --decode-tokens: '0' is not an integer in [4, 4096]"),
        # of one token, decode was the clock's noise: 10**9 tok/s
        (["--decode-tokens", "1"], "argument --decode-tokens: '1' is not an integer in [4, 4096]"),
        (["--rounds", "-1"], "argument --rounds: '-1' is not an integer in [1, 100]"),
        (["--stages", "0"], "argument --stages: '0' is not an integer in [1, 256]"),
        (["--threads", "1", "x"], "argument --threads: 'x' is not an integer in [1, 512]"),
        (["--prompt-tokens", "20000"], "argument --prompt-tokens: '20000' is not an integer in"),
        (["--model", "/nonexistent.gguf"], "no model at /nonexistent.gguf"),
        # 64 threads on 2 cores timed nothing for minutes
        (["--threads", str(CORES + 1)], f"--threads {CORES + 1} is more than the {CORES} cores"),
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


def test_the_engine_row_takes_a_prompt_longer_than_its_batch(smollm2: Path) -> None:
    """`dgr bench --prompt-tokens 5000` was a ShardError traceback (n_tokens 5000 outside
    [1, 512]): the engine's row prefills in forwards of its batch, as a route's stages do."""
    from dgr_bench.bench import engine_round
    from dgr_route.engine import locate

    engine = (
        locate()
        .module()
        .Engine(str(smollm2), 0, -1, n_threads=1, n_ctx=128, n_batch=16, max_sessions=1)
    )
    timed = engine_round(engine, list(range(1000, 1040)), 4)  # 40 tokens: 16, 16 and 8
    assert timed["prefill"] > 0 and timed["decode"] > 0
