"""Boundary codec: exact f32, measured f16/bf16, every bad field named, bf16 bits equal ggml's."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from dgr.v1 import shard_pb2 as pb
from dgr_wire.codec import (
    BoundaryError,
    BoundaryLimits,
    bf16_to_f32,
    chunks,
    decode,
    encode,
    f32_to_bf16,
    parse,
    prefix_hash,
)

LIMITS = BoundaryLimits(hc=1, n_embd=576, max_tokens=64)
RNG = np.random.default_rng(20261130)


def residual(n_tokens: int = 5) -> np.ndarray:
    return (RNG.standard_normal((n_tokens, 576)) * 3).astype(np.float32)


def test_f32_round_trip_is_exact() -> None:
    x = residual()
    msg = pb.Boundary.FromString(encode(x, "f32").SerializeToString())
    assert list(msg.shape) == [5, 1, 576]
    y = decode(msg, LIMITS)
    assert np.array_equal(y.view(np.uint32), x.view(np.uint32))


@pytest.mark.parametrize("dtype,bound", [("f16", 1e-6), ("bf16", 1e-4)])
def test_half_precision_error_is_small(dtype: str, bound: float) -> None:
    x = residual(32)
    y = decode(encode(x, dtype), LIMITS)
    back = y.astype(np.float32) if dtype == "f16" else bf16_to_f32(y)
    nmse = float(np.mean((back - x) ** 2) / np.mean(x**2))
    assert 0 < nmse < bound


def test_bf16_bits_match_the_engine(engine_module: ModuleType, smollm2: Path) -> None:
    head = engine_module.Engine(str(smollm2), 0, 10, n_ctx=128, n_batch=32, max_sessions=2)
    tokens = np.asarray(head.tokenize("bits on the wire", True), dtype=np.int32)
    f32 = head.forward(1, 1, 0, tokens=tokens)
    bf16 = head.forward(2, 1, 0, tokens=tokens, out_dtype="bf16")
    assert np.array_equal(f32_to_bf16(f32), bf16)


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda m: setattr(m, "dtype", 9), "dtype"),
        (lambda m: m.shape.__setitem__(2, 512), "shape"),
        (lambda m: m.shape.__setitem__(1, 4), "shape"),
        (lambda m: m.shape.pop(), "shape"),
        (lambda m: m.shape.__setitem__(0, 65), "shape"),
        (lambda m: setattr(m, "payload", m.payload[:-4]), "payload"),
        (lambda m: setattr(m, "crc32", m.crc32 ^ 1), "crc32"),
    ],
)
def test_bad_fields_are_named(mutate: object, field: str) -> None:
    msg = encode(residual(), "f32")
    mutate(msg)  # type: ignore[operator]
    with pytest.raises(BoundaryError) as info:
        decode(msg, LIMITS)
    assert info.value.field == field
    assert str(info.value).startswith(f"boundary.{field}: ")


def test_limits_and_accepted_dtypes() -> None:
    with pytest.raises(BoundaryError, match="not accepted here"):
        decode(encode(residual(), "f16"), BoundaryLimits(hc=1, n_embd=576, dtypes=("f32",)))
    with pytest.raises(BoundaryError, match="exceed the limit"):
        decode(encode(residual(), "f32"), BoundaryLimits(hc=1, n_embd=576, max_bytes=1000))
    with pytest.raises(BoundaryError, match=r"not a dgr\.v1\.Boundary"):
        parse(b"\xff\xff\xff\xff\x0f", LIMITS)


def test_corruption_in_transit_is_caught() -> None:
    wire = bytearray(encode(residual(), "f32").SerializeToString())
    wire[len(wire) // 2] ^= 0x40
    with pytest.raises(BoundaryError) as info:
        parse(bytes(wire), LIMITS)
    assert info.value.field in ("crc32", "payload", "message")


def test_chunks_and_prefix_hash() -> None:
    assert chunks(10, 4) == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert chunks(4, 4) == [slice(0, 4)]
    tokens = [1, 2, 3, 49151]
    assert prefix_hash(tokens[2:], prefix_hash(tokens[:2])) == prefix_hash(tokens)
    assert prefix_hash([1, 2]) != prefix_hash([2, 1])
