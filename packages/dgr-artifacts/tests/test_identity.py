"""GGUF identity on the real SmolLM2 file and on split sets made by gguf-split."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import gguf
import pytest
from dgr_artifacts.errors import (
    BadMagic,
    DuplicateSplitPart,
    IncompleteSplit,
    TruncatedGguf,
    UnsupportedGgufVersion,
)
from dgr_artifacts.identity import fingerprint, open_model, read_gguf, stored_fingerprint


def test_header_hparams_and_tensor_table(smollm2: Path) -> None:
    model = open_model(smollm2)
    assert (model.arch, model.n_layer) == ("llama", 30)
    assert model.hparams()["llama.embedding_length"] == 576
    assert model.hparams()["llama.attention.head_count_kv"] == 3
    # the tensor table as gguf's own reader sees it: every tensor, names and shapes
    reader = gguf.GGUFReader(smollm2)
    assert [t.name for t in model.tensors] == [t.name for t in reader.tensors]
    embd = next(t for t in model.tensors if t.name == "token_embd.weight")
    assert embd.shape == (576, 49152) and embd.dtype == "Q8_0" and embd.layer is None
    assert {t.layer for t in model.tensors if t.layer is not None} == set(range(30))


def test_cli_inspect(smollm2: Path) -> None:
    out = subprocess.run(
        ["dgr", "artifacts", "inspect", str(smollm2), "--tensors"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    info = json.loads(out)
    assert info["arch"] == "llama" and info["tensor_count"] == len(info["tensors"])
    # every tensor, in the file's order, as gguf's own reader lists them
    assert [t[0] for t in info["tensors"]] == [t.name for t in gguf.GGUFReader(smollm2).tensors]


def test_fingerprint_is_stable_and_split_invariant(
    smollm2: Path, split_sets: dict[str, Path]
) -> None:
    whole = fingerprint(open_model(smollm2))
    assert fingerprint(open_model(smollm2)) == whole
    for name, first in split_sets.items():
        model = open_model(first)
        assert len(model.parts) > 1, name
        assert fingerprint(model) == whole, name
        last = sorted(first.parent.glob("smol-*.gguf"))[-1]
        assert [p.path for p in open_model(last).parts] == [p.path for p in model.parts]


def test_fingerprint_sees_a_changed_tensor_byte(model_copy: Path, smollm2: Path) -> None:
    tensor = next(t for t in read_gguf(model_copy).tensors if t.name == "blk.7.ffn_up.weight")
    with model_copy.open("r+b") as fh:
        fh.seek(tensor.offset + 123)
        byte = fh.read(1)
        fh.seek(tensor.offset + 123)
        fh.write(bytes([byte[0] ^ 0x10]))
    assert fingerprint(open_model(model_copy)) != fingerprint(open_model(smollm2))


@pytest.mark.parametrize("keep", [10, 4000, 1_000_000, -1000])
def test_truncated_file_is_a_typed_error(model_copy: Path, keep: int) -> None:
    data = model_copy.read_bytes()
    model_copy.write_bytes(data[:keep])
    with pytest.raises(TruncatedGguf) as info:
        read_gguf(model_copy)
    assert str(model_copy) in str(info.value)
    # what is wrong with the file, not numpy's words for a short slice of it
    assert "dtype" not in str(info.value) and "axis" not in str(info.value), info.value


def test_a_directory_is_not_a_gguf(tmp_path: Path) -> None:
    with pytest.raises(IncompleteSplit, match="is a directory, not a GGUF file"):
        read_gguf(tmp_path)


def test_wrong_magic_and_version(model_copy: Path) -> None:
    data = bytearray(model_copy.read_bytes())
    model_copy.write_bytes(b"GGML" + data[4:])
    with pytest.raises(BadMagic, match="not a GGUF file"):
        read_gguf(model_copy)
    model_copy.write_bytes(b"GGUF" + struct.pack("<I", 99) + data[8:])
    with pytest.raises(UnsupportedGgufVersion, match="version 99"):
        read_gguf(model_copy)


def test_incomplete_and_duplicated_split_sets(split_sets: dict[str, Path], tmp_path: Path) -> None:
    parts = sorted(split_sets["tensors-100"].parent.glob("smol-*.gguf"))
    assert len(parts) == 3
    work = tmp_path / "set"
    shutil.copytree(parts[0].parent, work)
    (work / parts[1].name).unlink()
    with pytest.raises(IncompleteSplit, match=parts[1].name):
        open_model(work / parts[0].name)
    shutil.copyfile(work / parts[0].name, work / parts[1].name)
    with pytest.raises(DuplicateSplitPart, match=r"split\.no 0"):
        open_model(work / parts[0].name)


def test_a_stored_fingerprint_is_hashed_once_per_version_of_the_files(
    twin_copy: Path, tmp_path: Path, reads_no_model: Callable[[], AbstractContextManager[Any]]
) -> None:
    model_copy, store = twin_copy, tmp_path / "store"
    first = stored_fingerprint(model_copy, store)
    assert first == fingerprint(open_model(model_copy))
    with reads_no_model():
        assert stored_fingerprint(model_copy, store) == first  # from the store, nothing read
    tensor = read_gguf(model_copy).tensors[-1]
    with model_copy.open("r+b") as fh:  # a byte written in place: same size, a new ctime
        fh.seek(tensor.offset + 7)
        byte = fh.read(1)
        fh.seek(tensor.offset + 7)
        fh.write(bytes([byte[0] ^ 0x01]))
    changed = stored_fingerprint(model_copy, store)
    assert changed != first and changed == fingerprint(open_model(model_copy))
    with pytest.raises(IncompleteSplit, match="does not exist"):  # typed, as open_model's
        stored_fingerprint(tmp_path / "absent.gguf", store)
    # a store that cannot be written costs the hash, not the answer
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert stored_fingerprint(model_copy, blocked / "store") == changed


def test_a_stored_fingerprint_of_a_split_set_sees_a_change_in_any_part(
    split_sets: dict[str, Path], tmp_path: Path
) -> None:
    import shutil

    first = next(iter(split_sets.values()))
    copy = tmp_path / "split"
    shutil.copytree(first.parent, copy)
    head = copy / first.name
    store = tmp_path / "store"
    before = stored_fingerprint(head, store)
    last = sorted(copy.glob("smol-*.gguf"))[-1]
    tensor = read_gguf(last).tensors[-1]
    with last.open("r+b") as fh:
        fh.seek(tensor.offset)
        byte = fh.read(1)
        fh.seek(tensor.offset)
        fh.write(bytes([byte[0] ^ 0x01]))
    assert stored_fingerprint(head, store) != before  # the last part changed: hashed again
