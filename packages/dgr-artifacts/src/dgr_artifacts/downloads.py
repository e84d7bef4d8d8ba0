"""The machine-wide download cache and the one way DGR fetches from the package index (pip)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TextIO


class DownloadError(Exception):
    pass


def cache_dir() -> Path:
    """$DGR_CACHE, default ~/.cache/dgr: shared by every checkout on this machine."""
    return Path(os.environ.get("DGR_CACHE", Path.home() / ".cache" / "dgr"))


def pip_download(
    requirement: str, filename: str, dest: Path, *, sdist: bool, log: TextIO = sys.stderr
) -> Path:
    """Download one distribution file with pip (no dependencies) into `dest`, once."""
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / filename
    if target.is_file():
        return target
    log.write(f"download: {requirement} ({'sdist' if sdist else 'wheel'}) with pip\n")
    with tempfile.TemporaryDirectory(dir=dest, prefix=".download-") as tmp:
        kind = ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            *kind,
            "--disable-pip-version-check",
            "-q",
            requirement,
            "-d",
            tmp,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        got = Path(tmp) / filename
        if not got.is_file():
            raise DownloadError(
                f"pip could not download {requirement} as {filename} "
                f"(exit {done.returncode}): {done.stderr.strip()[-800:]}"
            )
        got.replace(target)
    return target
