"""Split sets of the real SmolLM2 made by llama.cpp's gguf-split (smollm2: packages/conftest.py)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest
from dgr_artifacts.manifest import ArtifactManifest, build_manifest

# name -> gguf-split arguments; the split sets the range-subset tests run on
SPLITS = {
    "tensors-100": ["--split-max-tensors", "100"],
    "tensors-60": ["--split-max-tensors", "60"],
    "size-32M": ["--split-max-size", "32M"],
}


@pytest.fixture(scope="session")
def gguf_split() -> Path:
    from dgr_llamacpp.build import tool
    from dgr_llamacpp.workspace import open_workspace

    return tool(open_workspace(), "llama-gguf-split")


@pytest.fixture(scope="session")
def split_sets(
    smollm2: Path, gguf_split: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """First part of each split set, in its own directory."""
    made = {}
    for name, args in SPLITS.items():
        out = tmp_path_factory.mktemp(f"split-{name}")
        subprocess.run(
            [str(gguf_split), "--split", *args, str(smollm2), str(out / "smol")],
            check=True,
            capture_output=True,
        )
        made[name] = sorted(out.glob("smol-*.gguf"))[0]
    return made


@pytest.fixture(scope="session")
def manifest(smollm2: Path) -> ArtifactManifest:
    return build_manifest(smollm2)


def _copy(model: Path, into: Path) -> Path:
    into.mkdir()
    return Path(shutil.copyfile(model, into / model.name))


@pytest.fixture
def model_copy(smollm2: Path, tmp_path: Path) -> Path:
    return _copy(smollm2, tmp_path / "model")


@pytest.fixture
def twin_copy(quick_twin: Path, tmp_path: Path) -> Path:
    """A copy of the 3.5 MB generated V4 quick twin, to write into."""
    return _copy(quick_twin, tmp_path / "twin")


@pytest.fixture
def reads_no_model(monkeypatch: pytest.MonkeyPatch) -> Callable[[], AbstractContextManager[Any]]:
    """A context in which opening a model fails the test (what a stored value must not do)."""

    @contextmanager
    def context() -> Iterator[None]:
        from dgr_artifacts import identity

        with monkeypatch.context() as m:
            m.setattr(identity, "open_model", lambda _: pytest.fail("the model was read again"))
            yield

    return context


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[object]:
    """mount(size, ro) -> a fresh tmpfs directory; unmounted afterwards. Needs root."""
    mounted: list[Path] = []

    def mount(size: str = "1m", ro: bool = False) -> Path:
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        opts = f"size={size}" + (",ro" if ro else "")
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], check=False)
