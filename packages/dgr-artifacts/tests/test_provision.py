"""Provisioning from a directory, file:// and an HTTP mirror on loopback; policy and failures."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
from dgr_artifacts.errors import (
    ForbiddenStorageRoot,
    HashMismatch,
    InsufficientSpace,
    ProvisionError,
)
from dgr_artifacts.manifest import ArtifactManifest
from dgr_artifacts.provision import StoragePolicy, provision, write_stream


class MirrorHandler(SimpleHTTPRequestHandler):
    """Static files with Range support; `corrupt` serves flipped bytes, `ranges` logs requests."""

    corrupt = False
    ranges: ClassVar[list[str]] = []

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        if self.corrupt:
            data = data[:5000] + bytes([data[5000] ^ 1]) + data[5001:]
        start = 0
        header = self.headers.get("Range")
        type(self).ranges.append(header or "")
        if header and header.startswith("bytes="):
            start = int(header[6:].split("-")[0])
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        self.wfile.write(data[start:])


@pytest.fixture
def mirror(smollm2: Path) -> Iterator[tuple[str, type[MirrorHandler]]]:
    handler = type("Handler", (MirrorHandler,), {"ranges": [], "corrupt": False})
    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(smollm2.parent))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()


def test_local_directory_then_kept(
    manifest: ArtifactManifest, smollm2: Path, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    first = provision(manifest, str(smollm2.parent), StoragePolicy(root))
    assert first.fetched == [smollm2.name] and first.bytes_copied == smollm2.stat().st_size
    assert (root / smollm2.name).read_bytes() == smollm2.read_bytes()
    assert not list(root.glob(".*.part"))
    again = provision(manifest, f"file://{smollm2.parent}", StoragePolicy(root))
    assert again.kept == [smollm2.name] and again.bytes_copied == 0


def test_http_mirror_resumes_a_partial_copy(
    manifest: ArtifactManifest,
    smollm2: Path,
    tmp_path: Path,
    mirror: tuple[str, type[MirrorHandler]],
) -> None:
    url, handler = mirror
    root = tmp_path / "store"
    root.mkdir()
    have = 12_345_678
    (root / f".{smollm2.name}.part").write_bytes(smollm2.read_bytes()[:have])
    report = provision(manifest, url, StoragePolicy(root))
    assert handler.ranges == [f"bytes={have}-"]
    assert report.resumed_bytes == have
    assert report.bytes_copied == smollm2.stat().st_size - have
    assert (root / smollm2.name).read_bytes() == smollm2.read_bytes()


def test_corrupt_mirror_leaves_nothing_under_the_final_name(
    manifest: ArtifactManifest,
    smollm2: Path,
    tmp_path: Path,
    mirror: tuple[str, type[MirrorHandler]],
) -> None:
    url, handler = mirror
    handler.corrupt = True
    root = tmp_path / "store"
    with pytest.raises(HashMismatch, match="chunk 0 does not match"):
        provision(manifest, url, StoragePolicy(root))
    assert list(root.iterdir()) == []


def test_storage_policy(manifest: ArtifactManifest, smollm2: Path, tmp_path: Path) -> None:
    with pytest.raises(ForbiddenStorageRoot, match="under /home"):
        provision(manifest, str(smollm2.parent), StoragePolicy(Path("/home/models")))
    with pytest.raises(ForbiddenStorageRoot, match="forbids"):
        provision(
            manifest,
            str(smollm2.parent),
            StoragePolicy(tmp_path / "no" / "here", forbidden=(tmp_path / "no",)),
        )


def test_full_disk_is_refused_before_writing(
    manifest: ArtifactManifest, smollm2: Path, tmpfs: Callable[..., Path]
) -> None:
    root = tmpfs("8m")
    with pytest.raises(InsufficientSpace, match=smollm2.name):
        provision(manifest, str(smollm2.parent), StoragePolicy(root))
    assert list(root.iterdir()) == []


def test_disk_filling_up_mid_write_is_a_clear_error(tmpfs: Callable[..., Path]) -> None:
    part = tmpfs("1m") / ".model.gguf.part"
    blocks = iter([os.urandom(256 * 1024)] * 8)
    with pytest.raises(ProvisionError, match="disk full while writing"):
        write_stream(part, blocks, append=False)
    assert not (part.parent / "model.gguf").exists()


def test_read_only_target(
    manifest: ArtifactManifest, smollm2: Path, tmpfs: Callable[..., Path]
) -> None:
    root = tmpfs("256m", ro=True)
    with pytest.raises(ProvisionError, match="not writable"):
        provision(manifest, str(smollm2.parent), StoragePolicy(root))
    assert list(root.iterdir()) == []
