"""Fuzzing the decoders of untrusted bytes: only BoundaryError, never anything else."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from dgr.v1 import shard_pb2 as pb
from dgr_wire.codec import BoundaryError, BoundaryLimits, decode, encode, parse
from hypothesis import given, settings
from hypothesis import strategies as st

LIMITS = BoundaryLimits(hc=1, n_embd=8, max_tokens=16, max_bytes=4096)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes(data: bytes) -> None:
    try:
        out = parse(data, LIMITS)
    except BoundaryError:
        return
    assert out.shape[1] == 8 and 1 <= out.shape[0] <= 16


@settings(max_examples=400, deadline=None)
@given(
    dtype=st.integers(-2, 6),
    shape=st.lists(st.integers(0, 40), max_size=5),
    payload=st.binary(max_size=700),
    crc=st.integers(0, 2**32 - 1),
)
def test_random_fields(dtype: int, shape: list[int], payload: bytes, crc: int) -> None:
    try:
        msg = pb.Boundary(dtype=dtype, shape=shape, payload=payload, crc32=crc)
    except ValueError:
        return  # protobuf itself refuses out-of-range values
    try:
        out = decode(msg, LIMITS)
    except BoundaryError:
        return
    assert out.nbytes == len(payload)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 16), st.sampled_from(["f32", "f16", "bf16"]), st.data())
def test_mutated_valid_messages(n_tokens: int, dtype: str, data: st.DataObject) -> None:
    wire = bytearray(encode(np.ones((n_tokens, 8), dtype=np.float32), dtype).SerializeToString())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(wire) - 1))
        wire[i] = data.draw(st.integers(0, 255))
    with contextlib.suppress(BoundaryError):
        parse(bytes(wire), LIMITS)


@pytest.mark.parametrize("n", [0, 17])
def test_token_count_limits(n: int) -> None:
    msg = encode(np.ones((max(n, 1), 8), dtype=np.float32), "f32")
    msg.shape[0] = n
    with pytest.raises(BoundaryError, match="n_tokens"):
        decode(msg, LIMITS)
