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


@pytest.fixture(scope="session")
def quick_twin() -> Path:
    """The generated DeepSeek V4 quick twin (6 main layers + MTP, hc = 4, 3 hash-routed layers)."""
    from dgr_native.twins import QUICK, twin_path

    return twin_path(QUICK)
