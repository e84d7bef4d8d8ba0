"""Resumable verification: verdicts, pinpointed corruption, and resume after SIGKILL."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from dgr_artifacts.manifest import ArtifactManifest, build_manifest, write_manifest
from dgr_artifacts.verify import BadChunk, verify

SMALL_CHUNK = 16 * 1024


def flip(path: Path, offset: int) -> None:
    with path.open("r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


def test_good_file_verifies(manifest: ArtifactManifest, smollm2: Path, tmp_path: Path) -> None:
    report = verify(manifest, smollm2.parent, tmp_path / "state")
    assert report.ok and report.bytes_hashed == smollm2.stat().st_size


def test_flipped_byte_is_pinpointed(manifest: ArtifactManifest, model_copy: Path) -> None:
    offset = 40_000_123
    flip(model_copy, offset)
    report = verify(manifest, model_copy.parent)
    chunk = manifest.files[0].chunk_size
    assert not report.ok
    assert report.bad == [
        BadChunk(
            model_copy.name, offset // chunk, offset // chunk * chunk, (offset // chunk + 1) * chunk
        )
    ]
    assert f"chunk {offset // chunk}" in str(report.bad[0])


def test_missing_and_resized_files(manifest: ArtifactManifest, model_copy: Path) -> None:
    with model_copy.open("ab") as fh:
        fh.write(b"extra")
    report = verify(manifest, model_copy.parent)
    assert not report.ok and "size" in report.problems[0]
    model_copy.unlink()
    assert "missing" in verify(manifest, model_copy.parent).problems[0]


def _run_verify(manifest_path: Path, model_dir: Path, state: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dgr_artifacts.cli",
            "verify",
            str(manifest_path),
            str(model_dir),
            "--state-dir",
            str(state),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def _progress(state: Path) -> int:
    files = list(state.glob("*.verify.json"))
    try:
        return int(json.loads(files[0].read_text())["next"]) if files else 0
    except (OSError, ValueError):
        return 0


def _killed_until_done(
    manifest_path: Path, model_dir: Path, state: Path, chunks: int, rng: random.Random
) -> tuple[int, str, list[int]]:
    """SIGKILL verification at random points of its progress until one run completes; returns
    the exit code, its output, and the chunk each killed run had reached."""
    targets = sorted(int(chunks * rng.uniform(lo, lo + 0.15)) for lo in (0.1, 0.3, 0.5, 0.7))
    reached: list[int] = []
    for target in targets:
        proc = _run_verify(manifest_path, model_dir, state)
        while proc.poll() is None and _progress(state) < target:
            time.sleep(0.002)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            reached.append(_progress(state))
    proc = _run_verify(manifest_path, model_dir, state)
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out, reached


def test_sigkill_at_random_moments_resumes_to_the_same_verdict(
    model_copy: Path, tmp_path: Path
) -> None:
    manifest = build_manifest(model_copy, SMALL_CHUNK)
    manifest_path = tmp_path / "manifest.json"
    write_manifest(manifest, manifest_path)
    bad_offset = 77_000_001
    flip(model_copy, bad_offset)
    reference = verify(manifest, model_copy.parent, tmp_path / "reference-state")
    assert [b.index for b in reference.bad] == [bad_offset // SMALL_CHUNK]

    state = tmp_path / "state"
    chunks = len(manifest.files[0].chunk_sha256)
    code, out, reached = _killed_until_done(
        manifest_path, model_copy.parent, state, chunks, random.Random(20261130)
    )
    mid_run = [n for n in reached if 0 < n < chunks]
    assert len(mid_run) >= 3, f"kills should land mid-run: reached {reached} of {chunks}"
    assert mid_run == sorted(mid_run), "each restart resumes, never starts over"
    progress = json.loads((state / f"{model_copy.name}.verify.json").read_text())
    assert progress["next"] == len(manifest.files[0].chunk_sha256)
    assert code == 1 and f"BAD {reference.bad[0]}" in out
    resumed = verify(manifest, model_copy.parent, state)
    assert resumed.bad == reference.bad and resumed.resumed_chunks == progress["next"]
