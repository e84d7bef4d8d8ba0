"""The boundary on the wire: encode a residual slice into dgr.v1.Boundary and decode untrusted
messages back, checking every field; prefill chunking and the rolling prefix hash.

Decoding never trusts the peer: dtype, shape (against the receiving stage's spec), size limits
and CRC-32 are checked before any byte is interpreted, and each failure is a BoundaryError that
names the field (the worker answers INVALID_ARGUMENT with it and keeps serving).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from dgr.v1 import shard_pb2 as pb
from google.protobuf.message import DecodeError

WIRE_DTYPES: dict[int, tuple[str, np.dtype]] = {
    pb.DTYPE_F32: ("f32", np.dtype("<f4")),
    pb.DTYPE_F16: ("f16", np.dtype("<f2")),
    pb.DTYPE_BF16: ("bf16", np.dtype("<u2")),  # raw bf16 bits; numpy has no bf16
}
BY_NAME = {name: code for code, (name, _) in WIRE_DTYPES.items()}
REAL_V4 = {"hc": 4, "n_embd": 4096}  # DeepSeek V4's mHC residual: 4 x n_embd per token


def seam_bytes(hc: int, n_embd: int) -> dict[str, int]:
    """Residual bytes per token crossing one seam, f32 and bf16, and the token-id sideband."""
    return {"f32": hc * n_embd * 4, "bf16": hc * n_embd * 2, "token_id_sideband": 4}


FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3


class BoundaryError(ValueError):
    def __init__(self, field: str, reason: str) -> None:
        self.field, self.reason = field, reason
        super().__init__(f"boundary.{field}: {reason}")


@dataclass(frozen=True)
class BoundaryLimits:
    """What the receiving stage accepts (from its DescribeReply)."""

    hc: int
    n_embd: int
    dtypes: tuple[str, ...] = ("f32", "f16", "bf16")
    max_tokens: int = 512
    max_bytes: int = 64 << 20


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round to nearest even, NaN kept quiet: the same bits as ggml_fp32_to_bf16_row_ref."""
    bits = np.ascontiguousarray(values, dtype="<f4").view("<u4").astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    out = np.where(nan, (bits >> 16) | 64, rounded).astype("<u2")
    return out


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype("<u4") << 16).view("<f4")


def encode(values: np.ndarray, dtype: str, hc: int = 1) -> pb.Boundary:
    """[n_tokens, hc * n_embd] (or [n_tokens, hc, n_embd]) in f32/f16/bf16-bits -> Boundary."""
    if dtype not in BY_NAME:
        raise BoundaryError("dtype", f"unknown dtype {dtype!r}")
    n_tokens = values.shape[0]
    width = int(np.prod(values.shape[1:]))
    if width % hc:
        raise BoundaryError("shape", f"row width {width} is not a multiple of hc={hc}")
    wire = WIRE_DTYPES[BY_NAME[dtype]][1]
    if values.dtype == wire:
        data = np.ascontiguousarray(values)
    elif dtype == "bf16":
        data = f32_to_bf16(values)
    else:
        data = np.ascontiguousarray(values, dtype=np.float32).astype(wire)
    payload = data.tobytes()
    return pb.Boundary(
        dtype=f"DTYPE_{dtype.upper()}",
        shape=[n_tokens, hc, width // hc],
        payload=payload,
        crc32=zlib.crc32(payload),
    )


def decode(msg: pb.Boundary, limits: BoundaryLimits) -> np.ndarray:
    """Boundary -> [n_tokens, hc * n_embd] array in its wire dtype, or BoundaryError."""
    if msg.dtype not in WIRE_DTYPES:
        raise BoundaryError("dtype", f"unknown dtype code {msg.dtype}")
    name, wire = WIRE_DTYPES[msg.dtype]
    if name not in limits.dtypes:
        raise BoundaryError("dtype", f"{name} is not accepted here ({', '.join(limits.dtypes)})")
    shape = list(msg.shape)
    if len(shape) != 3:
        raise BoundaryError("shape", f"expected [n_tokens, hc, n_embd], got {shape}")
    n_tokens, hc, n_embd = shape
    if hc != limits.hc or n_embd != limits.n_embd:
        raise BoundaryError(
            "shape",
            f"[{n_tokens}, {hc}, {n_embd}] does not match this "
            f"stage's [n_tokens, {limits.hc}, {limits.n_embd}]",
        )
    if not 1 <= n_tokens <= limits.max_tokens:
        raise BoundaryError("shape", f"n_tokens {n_tokens} outside [1, {limits.max_tokens}]")
    expected = n_tokens * hc * n_embd * wire.itemsize
    if expected > limits.max_bytes:
        raise BoundaryError("payload", f"{expected} bytes exceed the limit {limits.max_bytes}")
    if len(msg.payload) != expected:
        raise BoundaryError("payload", f"{len(msg.payload)} bytes, shape and dtype say {expected}")
    if zlib.crc32(msg.payload) != msg.crc32:
        raise BoundaryError("crc32", "checksum mismatch: the payload was corrupted in transit")
    return np.frombuffer(msg.payload, dtype=wire).reshape(n_tokens, hc * n_embd)


def parse(data: bytes, limits: BoundaryLimits) -> np.ndarray:
    """Untrusted serialized bytes -> array (DecodeError becomes a BoundaryError)."""
    if len(data) > limits.max_bytes + 1024:
        raise BoundaryError("payload", f"message of {len(data)} bytes exceeds the limit")
    try:
        msg = pb.Boundary.FromString(data)
    except DecodeError as exc:
        raise BoundaryError("message", f"not a dgr.v1.Boundary: {exc}") from exc
    return decode(msg, limits)


def chunks(n_tokens: int, max_tokens: int) -> list[slice]:
    """Prefill chunk boundaries: consecutive slices of at most max_tokens tokens."""
    if max_tokens < 1:
        raise ValueError("max_tokens must be positive")
    return [slice(i, min(i + max_tokens, n_tokens)) for i in range(0, n_tokens, max_tokens)]


def prefix_hash(tokens: Iterable[int], start: int = FNV_OFFSET) -> int:
    """Rolling FNV-1a 64 over little-endian int32 token ids (CacheExpectation.prefix_hash)."""
    h = start
    for token in tokens:
        for byte in int(token).to_bytes(4, "little", signed=True):
            h = ((h ^ byte) * FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h


def decode_logits(msg: pb.Boundary) -> np.ndarray:
    """The tail's [1, 1, n_vocab] f32 logits (Sampling.want_logits) -> [n_vocab] array."""
    if len(msg.shape) != 3 or msg.shape[0] != 1 or msg.shape[1] != 1:
        raise BoundaryError("shape", f"logits must be [1, 1, n_vocab], got {list(msg.shape)}")
    limits = BoundaryLimits(hc=1, n_embd=msg.shape[2], dtypes=("f32",), max_tokens=1)
    row: np.ndarray = decode(msg, limits)[0]
    return row
