"""DeepSeek V4 twins: `deepseek4` GGUFs with the real model's structure at small width and random,
seeded weights, made by llama.cpp's own loader and saver (`llama_model_init_from_user` +
`llama_model_save_to_file`, the route the pinned tree's tests/test-llama-archs.cpp takes).

No V4 weights can be had here, so certification of the V4 seam runs on these. The *full* twin
keeps what the seam and the per-layer state depend on: 43 main layers and one MTP layer, the mHC
residual (hc = 4), 256 routed + 1 shared experts with 6 active, three hash-routed layers, the
0/4/128 compress-ratio pattern (SWA, CSA with indexer, HCA) and sqrtsoftplus gating. The *quick*
twin has the same parts in 6 layers and 16 experts, for fast tests and the demo.

A twin is generated once per machine into `$DGR_CACHE/models/twins/` under a name that hashes its
spec and the generator version; the same spec always gives the same bytes (the fingerprints are
recorded in `artifacts/twins/*.manifest.json` and checked by tests).

llama.cpp builds from metadata alone only main layers (the MTP probe needs a tensor on file), so
the generator saves all blocks as main layers and then turns the last one into the MTP block:
`nextn_predict_layers = 1` and its `nextn.{eh_proj,enorm,hnorm}` projection tensors.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import gguf
import numpy as np
from dgr_artifacts.downloads import cache_dir

from dgr_native import load

ARCH = "deepseek4"
GENERATOR_VERSION = 1
CSA, HCA = 4, 128


def _digest(spec: TwinSpec | ArchTwin) -> str:
    """The twin's cache key: its spec and the generator version (the bytes depend on both)."""
    text = json.dumps({"spec": asdict(spec), "generator": GENERATOR_VERSION}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class TwinSpec:
    name: str
    n_layer: int  # main layers; one MTP layer follows them
    n_embd: int
    n_head: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    hash_layers: int
    n_vocab: int
    sliding_window: int
    indexer_heads: int
    indexer_head_dim: int
    indexer_top_k: int
    seed: int
    stdev: float = 0.1
    hc: int = 4

    def compress_ratios(self) -> list[int]:
        """Two SWA-only layers, then CSA (4) and HCA (128) alternating; the MTP layer is SWA."""
        main = [0, 0] + [CSA if i % 2 == 0 else HCA for i in range(2, self.n_layer)]
        return [*main, 0]

    def digest(self) -> str:
        return _digest(self)


_FULL_SPEC = TwinSpec(
    name="dsv4-twin",
    n_layer=43,
    n_embd=64,
    n_head=2,
    head_dim=64,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    n_expert=256,
    n_expert_used=6,
    n_ff_exp=32,
    hash_layers=3,
    n_vocab=4096,
    sliding_window=16,
    indexer_heads=4,
    indexer_head_dim=64,
    indexer_top_k=8,
    seed=20261130,
)
# the same parts at test size: fewer layers, experts and tokens
_QUICK_SPEC = replace(_FULL_SPEC, name="dsv4-twin-quick", n_layer=6, n_expert=16, n_vocab=1024)


@dataclass(frozen=True)
class ArchTwin:
    """A random-weight model of another architecture (range ownership beyond V4, DGR-033)."""

    name: str
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    extra: tuple[tuple[str, object], ...] = ()  # arch-specific keys, without the arch prefix
    expert_f16: bool = False
    seed: int = 20261130
    stdev: float = 0.1

    def metadata(self) -> dict[str, object]:
        a = self.arch
        kv: dict[str, object] = {
            f"{a}.vocab_size": self.n_vocab,
            f"{a}.context_length": 4096,
            f"{a}.embedding_length": self.n_embd,
            f"{a}.block_count": self.n_layer,
            f"{a}.feed_forward_length": self.n_ff,
            f"{a}.attention.head_count": self.n_head,
            f"{a}.attention.head_count_kv": self.n_head_kv,
            f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
            f"{a}.rope.freq_base": 10000.0,
        }
        kv.update({f"{a}.{key}": value for key, value in self.extra})
        kv["tokenizer.ggml.model"] = "test"
        kv["tokenizer.ggml.tokens"] = [f"tok_{i}" for i in range(self.n_vocab)]
        kv["tokenizer.ggml.scores"] = [0.0] * self.n_vocab
        return kv

    def types(self) -> dict[str, str]:
        if not self.expert_f16:
            return {}
        return {
            f"blk.{il}.ffn_{part}_exps.weight": "f16"
            for il in range(self.n_layer)
            for part in ("gate", "up", "down")
        }

    def digest(self) -> str:
        return _digest(self)


ARCH_TWINS = [
    ArchTwin(
        "qwen2-twin", "qwen2", n_layer=8, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, n_vocab=1024
    ),
    ArchTwin(
        "qwen3-twin", "qwen3", n_layer=8, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, n_vocab=1024
    ),
    ArchTwin(
        "deepseek2-twin",
        "deepseek2",
        n_layer=6,
        n_embd=128,
        n_head=1,
        n_head_kv=1,
        n_ff=192,
        n_vocab=1024,
        extra=(
            ("leading_dense_block_count", 1),
            ("attention.q_lora_rank", 512),
            ("attention.kv_lora_rank", 512),
            ("attention.key_length", 576),
            ("attention.value_length", 512),
            ("attention.key_length_mla", 192),
            ("attention.value_length_mla", 128),
            ("rope.dimension_count", 64),
            ("expert_count", 16),
            ("expert_used_count", 4),
            ("expert_shared_count", 1),
            ("expert_feed_forward_length", 64),
            ("expert_weights_scale", 1.0),
            ("expert_weights_norm", True),
            ("expert_gating_func", 2),  # sigmoid, as DeepSeek V3
        ),
        expert_f16=True,
    ),
]
Twin = TwinSpec | ArchTwin
TWINS: dict[str, Twin] = {t.name: t for t in [_FULL_SPEC, _QUICK_SPEC]}
TWINS.update({t.name: t for t in ARCH_TWINS})
QUICK = _QUICK_SPEC.name
FULL = _FULL_SPEC.name


def metadata(spec: TwinSpec) -> dict[str, object]:
    """The key/values llama.cpp's deepseek4 loader reads (all blocks as main layers)."""
    a = ARCH
    return {
        f"{a}.vocab_size": spec.n_vocab,
        f"{a}.context_length": 4096,
        f"{a}.embedding_length": spec.n_embd,
        f"{a}.block_count": spec.n_layer + 1,
        f"{a}.feed_forward_length": 4 * spec.n_embd,
        f"{a}.attention.head_count": spec.n_head,
        f"{a}.attention.head_count_kv": 1,
        f"{a}.attention.key_length": spec.head_dim,
        f"{a}.attention.value_length": spec.head_dim,
        f"{a}.rope.dimension_count": spec.head_dim // 2,
        f"{a}.rope.freq_base": 10000.0,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{a}.attention.q_lora_rank": spec.q_lora_rank,
        f"{a}.attention.sliding_window": spec.sliding_window,
        f"{a}.attention.output_group_count": spec.o_groups,
        f"{a}.attention.output_lora_rank": spec.o_lora_rank,
        f"{a}.attention.compress_ratios": spec.compress_ratios(),
        f"{a}.attention.compress_rope_freq_base": 160000.0,
        f"{a}.attention.indexer.head_count": spec.indexer_heads,
        f"{a}.attention.indexer.key_length": spec.indexer_head_dim,
        f"{a}.attention.indexer.top_k": spec.indexer_top_k,
        f"{a}.hyper_connection.count": spec.hc,
        f"{a}.hyper_connection.sinkhorn_iterations": 2,
        f"{a}.hyper_connection.epsilon": 1e-6,
        f"{a}.hash_layer_count": spec.hash_layers,
        f"{a}.expert_count": spec.n_expert,
        f"{a}.expert_used_count": spec.n_expert_used,
        f"{a}.expert_shared_count": 1,
        f"{a}.expert_feed_forward_length": spec.n_ff_exp,
        f"{a}.expert_gating_func": 4,  # sqrtsoftplus
        f"{a}.expert_weights_scale": 1.0,
        f"{a}.expert_weights_norm": True,
        f"{a}.swiglu_clamp_exp": 10.0,
        "tokenizer.ggml.model": "test",
        "tokenizer.ggml.tokens": [f"tok_{i}" for i in range(spec.n_vocab)],
        "tokenizer.ggml.scores": [0.0] * spec.n_vocab,
    }


def tensor_types(spec: TwinSpec) -> dict[str, str]:
    """Expert matrices in f16 (they are most of the file), hash-routing tables as expert ids."""
    types = {}
    for il in range(spec.n_layer + 1):
        for part in ("gate", "up", "down"):
            types[f"blk.{il}.ffn_{part}_exps.weight"] = "f16"
        if il < spec.hash_layers:
            types[f"blk.{il}.ffn_gate_tid2eid.weight"] = "i32"
    return types


def _write_metadata(arch: str, kv: dict[str, object], path: Path) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list) and value and isinstance(value[0], int):
            writer.add_key_value(
                key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT32
            )
        else:
            writer.add_array(key, value)  # type: ignore[arg-type]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def _optional_extra(name: str) -> bool:
    """Optional tensors the loader creates when building from metadata, absent from the real
    text model: the vision routing bias and the weight/input scales of quantized checkpoints
    (random scales would rescale the experts; the mHC `hc_*_scale` tensors are real)."""
    if name.endswith("_vl.bias") or name.endswith(".input_scale"):
        return True
    return name.endswith(".scale") and "hc_" not in name


def _rewrite(
    arch: str, raw: Path, out: Path, extra_kv: dict[str, int], extra: dict[str, np.ndarray]
) -> None:
    """Copy `raw` without the optional extras, with `extra_kv` (uint32) set and `extra` added."""
    reader = gguf.GGUFReader(str(raw))
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name in extra_kv:
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY and not field.data:
            continue  # llama.cpp's saver writes unused per-layer arrays empty; loaders skip them
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for key, value in extra_kv.items():
        writer.add_uint32(key, value)
    for t in reader.tensors:
        if _optional_extra(t.name):
            continue
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, data in extra.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _mtp_block(spec: TwinSpec) -> dict[str, np.ndarray]:
    """The MTP layer's projections, which llama.cpp does not build from metadata."""
    rng = np.random.default_rng(spec.seed)
    mtp = spec.n_layer
    eh_proj = rng.normal(0.0, spec.stdev, (spec.n_embd, 2 * spec.n_embd)).astype(np.float32)
    out = {f"blk.{mtp}.nextn.eh_proj.weight": eh_proj}
    for norm in ("enorm", "hnorm"):
        out[f"blk.{mtp}.nextn.{norm}.weight"] = rng.normal(0.0, spec.stdev, spec.n_embd).astype(
            np.float32
        )
    return out


def generate(spec: Twin, out: Path) -> Path:
    """Write the twin to `out` (atomically: a temp file in the same directory, then a rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(spec, TwinSpec):
        arch, kv, types = ARCH, metadata(spec), tensor_types(spec)
        extra_kv, extra = {f"{ARCH}.nextn_predict_layers": 1}, _mtp_block(spec)
    else:
        arch, kv, types, extra_kv, extra = spec.arch, spec.metadata(), spec.types(), {}, {}
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".twin-") as tmp:
        meta, raw, final = Path(tmp, "meta.gguf"), Path(tmp, "raw.gguf"), Path(tmp, "twin.gguf")
        _write_metadata(arch, kv, meta)
        load().generate_random_model(str(meta), str(raw), spec.seed, spec.stdev, types)
        _rewrite(arch, raw, final, extra_kv, extra)
        with final.open("rb") as f:
            os.fsync(f.fileno())
        final.replace(out)
    return out


def registry() -> dict[str, Callable[[], Path]]:
    """The twins as generated models (entry point `dgr.generated_models`)."""
    return {name: functools.partial(twin_path, name) for name in TWINS}


def twin_path(name: str) -> Path:
    """The twin's GGUF, generated once per machine and spec."""
    spec = TWINS[name]
    target = cache_dir() / "models" / "twins" / f"{spec.name}-{spec.digest()}.gguf"
    if not target.is_file():
        generate(spec, target)
    return target
