"""scripts/device-alpha.sh, the one call a lent GPU host gets: valid bash, and every command it
runs takes the options it passes (parsed by the commands themselves, --help), so a renamed flag
fails here instead of on the device. Its --dry run (the same steps on the CPU lane, ~8 minutes
here) is recorded in evidence/device/."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "device-alpha.sh"


def test_the_script_is_valid_bash() -> None:
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("module", "flags"),
    [
        ("dgr_cert.certify", ["--lane", "--model", "--stages", "--out"]),
        ("dgr_bench.bench", ["--rounds", "--paired-rounds", "--threads", "--pin-stages"]),
        ("dgr_bench.bench_wan", ["--threads", "--pin-stages"]),
    ],
)
def test_every_module_the_script_runs_takes_its_flags(module: str, flags: list[str]) -> None:
    text = SCRIPT.read_text()
    assert f"python -m {module} " in text
    for flag in flags:
        assert flag in text, (module, flag)
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    for flag in flags:
        assert re.search(rf"(^|\s){re.escape(flag)}\b", done.stdout), (module, flag, done.stdout)
