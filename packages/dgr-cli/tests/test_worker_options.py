"""The worker's one option table: every worker command line the documentation shows (README.md,
docs/, the Containerfile's ENTRYPOINT) goes through `dgr worker --check-args`, which resolves
dgr's own options and hands the rest to dgr-shard-worker's table to parse, so a documented flag the
worker does not take fails here. Inline mentions (`dgr worker --mtp`) are completed with the
options a start needs; `...` stands for them already."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from dgr_artifacts.manifest import build_manifest
from dgr_artifacts.recipe import Recipe, main_quantization, write_recipe

ROOT = Path(__file__).resolve().parents[3]
DGR = str(Path(sys.executable).parent / "dgr")
COMMAND = re.compile(r"(?:uv run )?(?:dgr worker|dgr-shard-worker)(?=\s+-|\s*$)[^`\n]*")
# placeholders the documentation writes for values
PLACEHOLDERS = {"N": "1", "L": "cpu", "F": "/dev/null", "FILE": "/dev/null"}


def documented() -> list[tuple[str, str]]:
    """(where, command line) for each worker command line in the documentation."""
    found: list[tuple[str, str]] = []
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for path in docs:
        text = path.read_text()
        # fenced blocks: whole command lines; elsewhere inline code, which may wrap
        blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
        prose = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S).replace("\n", " ")
        for block in blocks:
            for line in block.splitlines():
                if m := COMMAND.match(line.strip()):
                    found.append((f"{path.name} (block)", m.group(0)))
        for span in re.findall(r"`([^`]+)`", prose):
            if m := COMMAND.match(span.strip()):
                found.append((f"{path.name} (inline)", m.group(0)))
    container = (ROOT / "Containerfile").read_text()
    entry = re.search(r"^ENTRYPOINT (\[.*\])$", container, re.M)
    assert entry, "the Containerfile has no ENTRYPOINT"
    found.append(("Containerfile ENTRYPOINT", shlex.join(json.loads(entry.group(1)))))
    return found


COMMANDS = documented()


@pytest.fixture(scope="module")
def recipe_file(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    manifest = build_manifest(smollm2)
    n = manifest.n_layer
    recipe = Recipe(
        name="docs",
        model_fingerprint=manifest.model_fingerprint,
        manifest_sha256=manifest.digest(),
        quantization=main_quantization(manifest),
        wire_dtype="bf16",
        stages=[
            {"node": "a", "layers": {"first": 0, "last": n // 2}},
            {"node": "b", "layers": {"first": n // 2, "last": n}},
        ],
    )
    path = tmp_path_factory.mktemp("recipe") / "recipe.json"
    write_recipe(recipe, path)
    return path


def as_run(line: str, smollm2: Path, recipe: Path) -> list[str]:
    """The documented line as `dgr worker --check-args ...`, or for dgr-shard-worker itself the
    worker binary's `--check-args` (placeholders filled in)."""
    from dgr_route.engine import locate

    line = line.split(" #", 1)[0].replace("...", " ").replace("&", " ")
    line = line.replace('"$MODEL"', str(smollm2)).replace("$MODEL", str(smollm2))
    words = [PLACEHOLDERS.get(w, w) for w in shlex.split(line.removeprefix("uv run "))]
    words = [str(recipe) if w == "recipe.json" else w for w in words]
    if words[0] == "dgr-shard-worker":
        args = words[1:]
        if "--model" not in args:
            args = ["--model", str(smollm2), *args]
        return [str(locate().worker), "--check-args", *args]
    args = words[2:]
    if not {"--layers", "--recipe"} & set(args):
        args += ["--layers", "0:15"]  # an inline mention of a flag: the rest of a start
    return [DGR, "worker", "--check-args", *args]


def test_the_documentation_shows_worker_command_lines() -> None:
    places = {where.split(" ")[0] for where, _ in COMMANDS}
    assert {"README.md", "Containerfile"} <= places, COMMANDS
    assert len(COMMANDS) >= 10, COMMANDS


@pytest.mark.parametrize(("where", "line"), COMMANDS, ids=[f"{w}: {c}"[:90] for w, c in COMMANDS])
def test_every_documented_worker_command_line_parses(
    where: str, line: str, smollm2: Path, recipe_file: Path
) -> None:
    cmd = as_run(line, smollm2, recipe_file)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"{where}: {line}\n{' '.join(cmd)}\n{done.stderr[-2000:]}"
    if "--check-args" in cmd and "--help" not in line:
        resolved = dict(row.split(" = ", 1) for row in done.stdout.splitlines() if " = " in row)
        assert resolved.get("model") == str(smollm2) or "--version" in line, done.stdout
        for flag in re.findall(r"--([a-z][a-z-]+) ([^-\s]\S*)", line.replace('"', "")):
            key = flag[0].replace("-", "_")
            value = PLACEHOLDERS.get(flag[1], flag[1])
            skip = value in {"$MODEL", "recipe.json"} or "--version" in line
            if key in resolved and not skip:
                assert resolved[key] == value, (key, resolved[key], line)


def test_a_flag_the_worker_does_not_take_is_refused_by_name(smollm2: Path) -> None:
    base = [DGR, "worker", "--check-args", "--model", str(smollm2), "--layers", "0:15"]
    done = subprocess.run(
        [*base, "--frobnicate"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert "--frobnicate" in done.stderr
    bad = subprocess.run(
        [*base, "--prio", "9"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2 and "--prio: 9 is not an integer in [0, 3]" in bad.stderr
    # a command of dgr's own still refuses what it does not know
    other = subprocess.run(
        [DGR, "health", "127.0.0.1:1", "--frobnicate"], capture_output=True, text=True, check=False
    )
    assert other.returncode == 2 and "unrecognized arguments: --frobnicate" in other.stderr


def test_dgr_worker_help_lists_the_workers_options() -> None:
    done = subprocess.run([DGR, "worker", "--help"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    for flag in ("--recipe", "--prio", "--rollback", "--prefix-cache-bytes", "--check-args"):
        assert flag in done.stdout, flag
