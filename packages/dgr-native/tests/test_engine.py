"""ShardEngine through its Python module: ranges, boundaries, sessions and typed errors."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

OPTS: dict[str, int] = {"n_threads": 2, "n_ctx": 256, "n_batch": 128, "max_sessions": 2}


def engine(module: ModuleType, model: Path, first: int, last: int, **extra: int) -> Any:
    return module.Engine(str(model), first, last, **{**OPTS, **extra})


def shard_error(info: pytest.ExceptionInfo[BaseException]) -> str:
    return str(getattr(info.value, "status", ""))


def test_describe_head_middle_tail(engine_module: ModuleType, smollm2: Path) -> None:
    head, middle, tail = (
        engine(engine_module, smollm2, a, b) for a, b in [(0, 10), (10, 20), (20, 30)]
    )
    d = [e.describe() for e in (head, middle, tail)]
    assert [(x["is_head"], x["is_tail"]) for x in d] == [
        (True, False),
        (False, False),
        (False, True),
    ]
    assert all(x["n_embd"] == 576 and x["hc"] == 1 and x["n_layer"] == 30 for x in d)
    assert [x["needs_token_ids"] for x in d] == [True, False, False]


def test_loaded_weights_are_the_range_subset(
    engine_module: ModuleType, smollm2: Path, smollm2_manifest: Any
) -> None:
    from dgr_artifacts.subset import range_subset

    for first, last in [(0, 10), (10, 20), (20, 30), (3, 4)]:
        loaded = engine(engine_module, smollm2, first, last).describe()["model_buffer_bytes"]
        owned = range_subset(smollm2_manifest, first, last).total_bytes
        assert owned <= loaded <= owned * 1.01, (first, last, loaded, owned)


def test_kv_is_allocated_for_owned_layers_only(engine_module: ModuleType, smollm2: Path) -> None:
    full = engine(engine_module, smollm2, 0, 30).describe()["kv_bytes"]
    parts = [
        engine(engine_module, smollm2, a, b).describe()["kv_bytes"]
        for a, b in [(0, 10), (10, 25), (25, 30)]
    ]
    assert parts == [full * 10 // 30, full * 15 // 30, full * 5 // 30]


def test_chain_output_shapes_and_dtypes(engine_module: ModuleType, smollm2: Path) -> None:
    head, tail = engine(engine_module, smollm2, 0, 15), engine(engine_module, smollm2, 15, 30)
    tokens = np.asarray(head.tokenize("Hello there", True), dtype=np.int32)
    for dtype, np_dtype in [("f32", np.float32), ("f16", np.float16), ("bf16", np.uint16)]:
        session = {"f32": 1, "f16": 2, "bf16": 3}[dtype]
        boundary = head.forward(session, 1, 0, tokens=tokens, out_dtype=dtype)
        assert boundary.shape == (len(tokens), 576) and boundary.dtype == np_dtype
        assert not boundary.flags.owndata  # handed over from C++ without a copy
        logits = tail.forward(session, 1, 0, boundary=boundary)
        assert logits.shape == (1, 49152) and logits.dtype == np.float32
        head.release(session)
        tail.release(session)


@pytest.mark.parametrize("first,last", [(5, 5), (-1, 3), (0, 31), (20, 10)])
def test_bad_ranges(engine_module: ModuleType, smollm2: Path, first: int, last: int) -> None:
    with pytest.raises(engine_module.ShardError, match=r"not inside \[0, 30\)") as info:
        engine(engine_module, smollm2, first, last)
    assert shard_error(info) == "invalid_range"


def test_bad_model_files(engine_module: ModuleType, smollm2: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(smollm2.read_bytes()[:1_000_000])
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    for path, needle in [
        (truncated, "truncated.gguf"),
        (not_gguf, "bad magic"),
        (tmp_path / "missing.gguf", "cannot open"),
        (tmp_path, "is a directory, not a GGUF file"),  # it was "truncated"
    ]:
        with pytest.raises(engine_module.ShardError, match=needle) as info:
            engine_module.Engine(str(path), 0, 10)
        assert shard_error(info) == "load_failed"


def test_a_context_past_32_bits_is_refused(engine_module: ModuleType, smollm2: Path) -> None:
    """Every session's KV is one llama context of n_ctx x max_sessions cells: 2**24 x 256 wrapped
    to 0, which llama.cpp takes as the model's training context, and the engine started at once
    reporting 16M tokens a session it did not have."""
    with pytest.raises(engine_module.ShardError, match="n_ctx 16777216 x max_sessions 256") as info:
        engine_module.Engine(str(smollm2), 0, 10, n_ctx=2**24, max_sessions=256)
    assert shard_error(info) == "invalid_argument"
    assert "more than one llama.cpp context holds" in str(info.value)


def test_unsupported_arch_for_a_range(engine_module: ModuleType, tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(engine_module.ShardError, match="arch 'gpt2'") as info:
        engine_module.Engine(str(path), 0, 2)
    assert shard_error(info) == "unsupported_arch"


def test_boundary_validation(engine_module: ModuleType, smollm2: Path) -> None:
    middle = engine(engine_module, smollm2, 10, 20)
    with pytest.raises(ValueError, match=r"\[n_tokens, 576\]"):
        middle.forward(1, 1, 0, boundary=np.zeros((4, 512), dtype=np.float32))
    with pytest.raises(TypeError, match="float32, float16 or uint16"):
        middle.forward(1, 1, 0, boundary=np.zeros((4, 576), dtype=np.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        middle.forward(1, 1, 0, boundary=np.zeros((576, 4), dtype=np.float32).T)
    with pytest.raises(engine_module.ShardError, match="needs a boundary input") as info:
        middle.forward(1, 1, 0, tokens=np.array([1, 2], dtype=np.int32))
    assert shard_error(info) == "invalid_argument"
    head = engine(engine_module, smollm2, 0, 10)
    with pytest.raises(engine_module.ShardError, match="token ids, not a boundary"):
        head.forward(1, 1, 0, boundary=np.zeros((2, 576), dtype=np.float32))
    with pytest.raises(engine_module.ShardError, match="outside the vocabulary"):
        head.forward(1, 1, 0, tokens=np.array([1, 49152], dtype=np.int32))
    with pytest.raises(TypeError, match="int32"):
        head.forward(1, 1, 0, tokens=np.array([1, 2], dtype=np.int64))
    with pytest.raises(engine_module.ShardError, match=r"outside \[1, 128\]"):
        head.forward(1, 1, 0, tokens=np.ones(129, dtype=np.int32))


def test_arrays_are_taken_by_dtype_not_by_dtype_object(
    engine_module: ModuleType, smollm2: Path
) -> None:
    """An array that crossed a process (pickled, as multiprocessing sends it) carries an equal
    dtype that is another object: it is accepted, and computes what the original does; an array of
    the other byte order is refused, since its bytes are not the engine's numbers."""
    import pickle

    head = engine(engine_module, smollm2, 0, 10)
    middle = engine(engine_module, smollm2, 10, 20)
    tokens = np.array([1, 2, 3], dtype=np.int32)
    sent = pickle.loads(pickle.dumps(tokens))
    assert sent.dtype is not np.dtype(np.int32)  # what made the identity check refuse it
    out = head.forward(1, 1, 0, tokens=sent)
    assert np.array_equal(out, head.forward(2, 1, 0, tokens=tokens))
    boundary = pickle.loads(pickle.dumps(out))
    assert np.array_equal(
        middle.forward(1, 1, 0, boundary=boundary), middle.forward(2, 1, 0, boundary=out)
    )
    with pytest.raises(TypeError, match="int32"):
        head.forward(3, 1, 0, tokens=tokens.astype(">i4"))
    with pytest.raises(TypeError, match="float32, float16 or uint16"):
        middle.forward(3, 1, 0, boundary=out.astype(">f4"))


def test_cache_expectations(engine_module: ModuleType, smollm2: Path) -> None:
    middle = engine(engine_module, smollm2, 10, 20)
    x = np.zeros((3, 576), dtype=np.float32)
    with pytest.raises(engine_module.ShardError, match="holds no cache") as info:
        middle.forward(7, 1, 5, boundary=x)
    assert shard_error(info) == "unknown_session"
    middle.forward(7, 2, 0, boundary=x)
    with pytest.raises(engine_module.ShardError, match="stale epoch 1") as info:
        middle.forward(7, 1, 3, boundary=x)
    assert shard_error(info) == "cache_mismatch"
    with pytest.raises(engine_module.ShardError, match="expects n_past 2 but the shard holds 3"):
        middle.forward(7, 2, 2, boundary=x)
    with pytest.raises(engine_module.ShardError, match="must start at n_past 0"):
        middle.forward(7, 3, 3, boundary=x)
    assert middle.forward(7, 2, 3, boundary=x).shape == (3, 576)  # still serving the session
    middle.forward(7, 3, 0, boundary=x)  # new epoch: cache miss, re-prefill
    assert middle.sessions() == [7]


def test_sessions_capacity_and_release(engine_module: ModuleType, smollm2: Path) -> None:
    middle = engine(engine_module, smollm2, 10, 20, max_sessions=1)
    x = np.zeros((2, 576), dtype=np.float32)
    middle.forward(1, 1, 0, boundary=x)
    with pytest.raises(engine_module.ShardError, match="session slots are in use") as info:
        middle.forward(2, 1, 0, boundary=x)
    assert shard_error(info) == "capacity"
    middle.release(1)
    middle.forward(2, 1, 0, boundary=x)
    with pytest.raises(engine_module.ShardError, match="no session 1") as info:
        middle.release(1)
    assert shard_error(info) == "unknown_session"


def test_an_engine_without_sessions_takes_no_cpu(engine_module: ModuleType, smollm2: Path) -> None:
    """Between forwards the compute pool polls for the next graph (poll 50); once the last session
    is released it sleeps. Before, its second thread spun on for 0.1-0.3 s after a generation,
    taking a core from whatever ran next on the host (the benches' routes, timed right after an
    in-process generation, computed their prefills beside it)."""
    full = engine(engine_module, smollm2, 0, 30, poll=50)
    prompt = np.arange(1000, 1032, dtype=np.int32)
    first = full.forward(1, 1, 0, tokens=prompt)
    for i in range(8):
        full.forward(1, 1, 32 + i, tokens=np.array([1000 + i], np.int32))
    full.release(1)
    cpu = time.process_time()
    time.sleep(0.3)
    idle = time.process_time() - cpu
    assert idle < 0.05, f"{idle:.3f} s of CPU in 0.3 s with no session: the pool kept polling"
    # the next forward wakes the pool: the same prompt computes the same logits
    np.testing.assert_array_equal(full.forward(2, 1, 0, tokens=prompt), first)


def test_gil_is_released_during_compute(engine_module: ModuleType, smollm2: Path) -> None:
    full = engine(engine_module, smollm2, 0, 30, n_batch=256, n_ctx=512)
    tokens = np.arange(1000, 1256, dtype=np.int32)
    ticks = 0
    done = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1

    counter = threading.Thread(target=count)
    counter.start()
    time.sleep(0.05)
    before = ticks
    full.forward(1, 1, 0, tokens=tokens)
    during = ticks - before
    done.set()
    counter.join()
    assert during > 10_000, "the Python thread should run while llama.cpp computes"


def test_model_copy_is_not_needed_elsewhere(
    engine_module: ModuleType, smollm2: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(smollm2, copy)
    e = engine(engine_module, copy, 10, 20)
    copy.unlink()  # weights were read into the shard's own buffers
    assert e.forward(1, 1, 0, boundary=np.zeros((2, 576), dtype=np.float32)).shape == (2, 576)
