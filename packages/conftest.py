"""Fixtures shared by every package's tests: the real SmolLM2 from the package index and the
real ShardEngine module (built on first use)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from dgr_artifacts.models import model_path

    return model_path()


@pytest.fixture(scope="session")
def engine_module() -> ModuleType:
    from dgr_native import load

    return load()
