"""GGUF identity: header, hyperparameters, tensor table, split sets and the model fingerprint.

Parsing is the `gguf` package's (GGUFReader); this module adds what it lacks for untrusted files:
checks of magic, version and truncation before and after parsing, typed errors, and split-set
completeness (split.count / split.no / split.tensors.count, as llama.cpp's gguf-split writes).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from dgr_artifacts.errors import (
    BadMagic,
    CorruptGguf,
    DuplicateSplitPart,
    IncompleteSplit,
    TruncatedGguf,
    UnsupportedGgufVersion,
)

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
HEADER_BYTES = 24  # magic, version u32, tensor count u64, kv count u64
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in its file
    nbytes: int
    file: str  # file name (no directory)

    @property
    def layer(self) -> int | None:
        match = LAYER_TENSOR.match(self.name)
        return int(match.group(1)) if match else None


@dataclass
class GgufFile:
    path: Path
    version: int
    size: int
    kv: dict[str, Any]
    tensors: list[TensorInfo]

    @property
    def split_no(self) -> int | None:
        value = self.kv.get("split.no")
        return None if value is None else int(value)


@dataclass
class GgufModel:
    """A model as one GGUF or a complete split set, parts in split order."""

    parts: list[GgufFile]
    tensors: list[TensorInfo] = field(init=False)

    def __post_init__(self) -> None:
        self.tensors = [t for part in self.parts for t in part.tensors]

    @property
    def kv(self) -> dict[str, Any]:
        return self.parts[0].kv

    @property
    def arch(self) -> str:
        return str(self.kv["general.architecture"])

    @property
    def n_layer(self) -> int:
        return int(self.kv[f"{self.arch}.block_count"])

    def hparams(self) -> dict[str, Any]:
        prefix = f"{self.arch}."
        return {k: v for k, v in sorted(self.kv.items()) if k.startswith(prefix)}


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value


def _check_header(path: Path, size: int) -> int:
    if size < HEADER_BYTES:
        raise TruncatedGguf(path, f"file is {size} bytes, shorter than a GGUF header")
    with path.open("rb") as fh:
        head = fh.read(8)
    if head[:4] != GGUF_MAGIC:
        raise BadMagic(path, f"magic is {head[:4]!r}, not {GGUF_MAGIC!r}: not a GGUF file")
    version: int = struct.unpack("<I", head[4:8])[0]
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedGgufVersion(
            path, f"GGUF version {version} is not supported (supported: {SUPPORTED_VERSIONS})"
        )
    return version


def read_gguf(path: Path) -> GgufFile:
    """Parse one GGUF file; every failure is a typed ArtifactError naming the file."""
    path = Path(path)
    if path.is_dir():
        raise IncompleteSplit(path, "is a directory, not a GGUF file")
    if not path.is_file():
        raise IncompleteSplit(path, "file does not exist")
    size = path.stat().st_size
    version = _check_header(path, size)
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, IndexError, struct.error, OverflowError) as exc:
        # GGUFReader slices a memmap: a header that runs past the end of the file surfaces as a
        # short slice (ValueError/IndexError), whether the file was cut or a length is garbage;
        # numpy's words for that slice say nothing about the file (they stay in __cause__)
        raise TruncatedGguf(
            path,
            f"header or tensor table runs past the end of the file ({size} bytes): cut short, "
            "or a length in it is not a GGUF's",
        ) from exc
    except (KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CorruptGguf(path, f"cannot parse the GGUF header: {exc!r}") from exc
    kv = {
        name: _plain(f.contents())
        for name, f in reader.fields.items()
        if not name.startswith("GGUF.")
    }
    tensors = []
    for t in reader.tensors:
        offset, nbytes = int(t.data_offset), int(t.n_bytes)
        if offset + nbytes > size:
            raise TruncatedGguf(
                path, f"tensor {t.name} needs bytes up to {offset + nbytes}, file has {size}"
            )
        tensors.append(
            TensorInfo(
                name=t.name,
                dtype=GGMLQuantizationType(int(t.tensor_type)).name,
                shape=tuple(int(d) for d in t.shape),
                offset=offset,
                nbytes=nbytes,
                file=path.name,
            )
        )
    if "general.architecture" not in kv and "split.no" not in kv:
        raise CorruptGguf(path, "no general.architecture key")
    return GgufFile(path=path, version=version, size=size, kv=kv, tensors=tensors)


def split_part_names(first: Path, count: int) -> list[Path]:
    match = SPLIT_NAME.match(first.name)
    if not match:
        raise IncompleteSplit(
            first, f"split.count is {count} but the name does not follow PREFIX-00001-of-NNNNN.gguf"
        )
    prefix = match.group("prefix")
    return [first.with_name(f"{prefix}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def open_model(path: Path) -> GgufModel:
    """Open a GGUF, or the complete split set that `path` (any part) belongs to."""
    first = read_gguf(Path(path))
    count = first.kv.get("split.count")
    if count is None or int(count) <= 1:
        return GgufModel([first])
    names = split_part_names(first.path, int(count))
    missing = [p.name for p in names if not p.is_file()]
    if missing:
        raise IncompleteSplit(first.path, f"split set of {count} lacks {', '.join(missing)}")
    parts = [first if p == first.path else read_gguf(p) for p in names]
    seen: dict[int, Path] = {}
    for index, part in enumerate(parts):
        no = part.split_no
        if no in seen:
            raise DuplicateSplitPart(part.path, f"claims split.no {no} like {seen[no].name}")
        if no is None or no != index or int(part.kv.get("split.count", -1)) != int(count):
            raise IncompleteSplit(
                part.path,
                f"is part {no} of {part.kv.get('split.count')}, expected part {index} of {count}",
            )
        seen[no] = part.path
    declared = int(first.kv.get("split.tensors.count", -1))
    found = sum(len(p.tensors) for p in parts)
    if declared != found:
        raise IncompleteSplit(first.path, f"split.tensors.count is {declared}, parts hold {found}")
    names_seen: set[str] = set()
    for t in (t for p in parts for t in p.tensors):
        if t.name in names_seen:
            raise DuplicateSplitPart(Path(t.file), f"tensor {t.name} appears in two parts")
        names_seen.add(t.name)
    return GgufModel(parts)


def tensor_sha256(t: TensorInfo, directory: Path) -> str:
    digest = hashlib.sha256()
    with (directory / t.file).open("rb") as fh:
        fh.seek(t.offset)
        remaining = t.nbytes
        while remaining:
            block = fh.read(min(remaining, 1 << 20))
            if not block:
                raise TruncatedGguf(directory / t.file, f"tensor {t.name} ends early")
            digest.update(block)
            remaining -= len(block)
    return digest.hexdigest()


def fingerprint(model: GgufModel) -> str:
    """Same for the same model on every machine, split or not: arch, hyperparameters, and each
    tensor's name, type, shape and data hash; file layout, names and split keys do not count."""
    directory = model.parts[0].path.parent
    doc = {
        "arch": model.arch,
        "hparams": model.hparams(),
        "tensors": sorted(
            [t.name, t.dtype, list(t.shape), tensor_sha256(t, directory)] for t in model.tensors
        ),
    }
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _file_version(path: Path) -> list[object]:
    """What changes when a file's bytes may have: where it is (device, inode), its size, its
    modification time and its status-change time (which any write moves, and no one sets)."""
    st = path.stat()
    return [str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def stored(
    path: Path, kind: str, compute: Callable[[GgufModel], Any], store: Path | None = None
) -> Any:
    """`compute(open_model(path))` (a JSON value), computed once per version of the model's
    files on this machine and kept in `store` (default $DGR_CACHE/<kind>) under the
    `_file_version` of `path` (one GGUF or any part of a split set), with every part's: asking
    again reads neither tensor data (hashing hundreds of GB takes minutes) nor the header
    (gguf's reader spends seconds on a large vocabulary), and a part written to since is read
    again. A store that cannot be read or written is skipped."""
    from dgr_artifacts.downloads import cache_dir

    try:
        name = hashlib.sha256(json.dumps(_file_version(path)).encode()).hexdigest()[:32]
    except OSError:  # no such file: open_model says so, typed
        return compute(open_model(path))
    entry = (store or cache_dir() / kind) / f"{name}.json"
    try:
        held = json.loads(entry.read_text(encoding="utf-8"))
        versions = held["versions"]
        if [_file_version(Path(v[0])) for v in versions] == versions:
            return held["value"]
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        pass
    model = open_model(path)
    value = compute(model)
    record = {"versions": [_file_version(p.path) for p in model.parts], "value": value}
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        partial = entry.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(record), encoding="utf-8")
        partial.replace(entry)
    except OSError:
        pass
    return value


def stored_fingerprint(path: Path, store: Path | None = None) -> str:
    """`fingerprint` of the model at `path`, as `stored` keeps it: what a worker start
    reports, without hashing the model at every start."""
    return str(stored(path, "fingerprints", fingerprint, store))
