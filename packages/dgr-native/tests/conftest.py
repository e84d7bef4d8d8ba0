"""The manifest of the real SmolLM2 (smollm2 and engine_module come from packages/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_manifest(smollm2: Path) -> object:
    from dgr_artifacts.manifest import build_manifest

    return build_manifest(smollm2)
