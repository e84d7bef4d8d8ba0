"""The real engine and model, for checks that the wire carries what the engine computes."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="session")
def engine_module() -> ModuleType:
    from dgr_native import load

    return load()


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from dgr_artifacts.models import model_path

    return model_path()
