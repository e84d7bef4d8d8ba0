"""The MTP ownership contract (DGR-067, docs/mtp.md) on the generated V4 quick twin, whose last
block is an MTP layer: the block is never a main range and only the tail serves it (--mtp). A range
into the block, and MTP asked of a stage that is not the tail, are refused with the reason, by the
engine and by worker processes; a range loaded without --mtp never reads the MTP tensors, and the
tail with --mtp loads them (DGR-068 builds the drafting: test_mtp.py)."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import gguf
import pytest
from dgr_cli.workers import WorkerStartError, start_worker

OPTS = {"n_threads": 2, "n_ctx": 256, "n_batch": 64, "max_sessions": 1}


def main_layers(model: Path) -> int:
    reader = gguf.GGUFReader(str(model))
    kv = {f.name: f.contents() for f in reader.fields.values()}
    assert kv["deepseek4.nextn_predict_layers"] == 1
    return int(kv["deepseek4.block_count"]) - 1


def test_the_engine_refuses_mtp_outside_the_tail(
    engine_module: ModuleType, quick_twin: Path
) -> None:
    n_layer = main_layers(quick_twin)
    with pytest.raises(
        engine_module.ShardError, match=rf"MTP block \(layers {n_layer}\.\."
    ) as info:
        engine_module.Engine(str(quick_twin), 3, n_layer + 1, **OPTS)
    assert info.value.status == "invalid_range"
    with pytest.raises(
        engine_module.ShardError, match=r"only the tail serves the MTP block"
    ) as info:
        engine_module.Engine(str(quick_twin), 0, 3, load_mtp=True, **OPTS)
    assert info.value.status == "invalid_argument"


def test_the_full_range_loads_without_the_mtp_block(
    engine_module: ModuleType, quick_twin: Path
) -> None:
    n_layer = main_layers(quick_twin)
    reader = gguf.GGUFReader(str(quick_twin))
    mtp_bytes = sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith(f"blk.{n_layer}."))
    main_bytes = sum(int(t.n_bytes) for t in reader.tensors) - mtp_bytes
    d = engine_module.Engine(str(quick_twin), **OPTS).describe()
    assert d["n_layer"] == n_layer and mtp_bytes > 0
    # buffers add alignment padding (bytes), the MTP layer would add a seventh of the model
    assert main_bytes <= d["weight_bytes"] < main_bytes + mtp_bytes // 10


def test_the_tail_with_mtp_loads_the_block(engine_module: ModuleType, quick_twin: Path) -> None:
    n_layer = main_layers(quick_twin)
    reader = gguf.GGUFReader(str(quick_twin))
    owned = sum(
        int(t.n_bytes)
        for t in reader.tensors
        if t.name.startswith((f"blk.{n_layer}.", "token_embd.", "output", "hc_head"))
        or any(t.name.startswith(f"blk.{i}.") for i in range(3, n_layer))
    )
    d = engine_module.Engine(str(quick_twin), 3, -1, load_mtp=True, **OPTS).describe()
    # the tail's layers, the MTP block and the token embedding it drafts from
    assert d["mtp"] and owned <= d["weight_bytes"] < owned * 1.01
    plain = engine_module.Engine(str(quick_twin), 3, -1, **OPTS).describe()
    assert not plain["mtp"] and plain["weight_bytes"] < d["weight_bytes"]


def test_workers_refuse_mtp_outside_the_tail(quick_twin: Path) -> None:
    n_layer = main_layers(quick_twin)
    for layers, extra, needle in [
        ((3, n_layer + 1), [], "reaches into the MTP block"),
        ((0, 3), ["--mtp"], "only the tail serves the MTP block"),
    ]:
        with pytest.raises(WorkerStartError, match=re.escape(needle)):
            start_worker(quick_twin, *layers, extra=extra, timeout=60)
