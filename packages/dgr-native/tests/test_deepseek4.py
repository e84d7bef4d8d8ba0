"""DeepSeek V4 range ownership on the generated quick twin, through the real patched llama.cpp:
the twin's structure and determinism, bitwise parity of split chains, the typed errors for a
wrong boundary, a missing token-ID sideband and the MTP block, and V4 state that belongs to the
owned layers and to one epoch."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import pytest
from dgr_native.parity import compare, reference_run
from dgr_native.scenarios import ModelStructure, generate
from dgr_native.twins import FULL, QUICK, TWINS, metadata
from dgr_native.twins import generate as generate_twin

OPTS = {"n_threads": 2, "n_ctx": 512, "n_batch": 512, "max_sessions": 2}
SPEC = TWINS[QUICK]


def prompt(n: int = 150, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, SPEC.n_vocab, n).astype(np.int32)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_quick_twin_is_deterministic_and_recorded(quick_twin: Path, tmp_path: Path) -> None:
    from dgr_artifacts.manifest import load_manifest
    from dgr_native.cli import twin_manifest_path

    again = generate_twin(SPEC, tmp_path / "again.gguf")
    recorded = load_manifest(twin_manifest_path(QUICK))
    assert sha256(again) == sha256(quick_twin) == recorded.files[0].sha256


def test_the_quick_twin_has_the_v4_structure(quick_twin: Path) -> None:
    reader = gguf.GGUFReader(str(quick_twin))
    kv = {f.name: f.contents() for f in reader.fields.values()}
    assert kv["general.architecture"] == "deepseek4"
    assert kv["deepseek4.block_count"] == SPEC.n_layer + 1
    assert kv["deepseek4.nextn_predict_layers"] == 1
    assert kv["deepseek4.hyper_connection.count"] == 4
    assert kv["deepseek4.hash_layer_count"] == 3
    assert kv["deepseek4.expert_gating_func"] == 4  # sqrtsoftplus
    assert set(kv["deepseek4.attention.compress_ratios"]) == {0, 4, 128}
    tensors = {t.name: t for t in reader.tensors}
    assert f"blk.{SPEC.n_layer}.nextn.eh_proj.weight" in tensors
    assert not [n for n in tensors if n.endswith(".input_scale") or n.endswith("_vl.bias")]
    assert tensors["blk.0.ffn_gate_exps.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    table = np.asarray(tensors["blk.0.ffn_gate_tid2eid.weight"].data)
    assert table.shape == (SPEC.n_vocab, SPEC.n_expert_used)
    assert table.min() >= 0 and table.max() < SPEC.n_expert
    assert all(len(set(row)) == SPEC.n_expert_used for row in table.tolist())


def test_the_full_twin_spec_matches_the_real_model_structure() -> None:
    spec = TWINS[FULL]
    kv = metadata(spec)
    assert kv["deepseek4.block_count"] == 44  # 43 main layers + 1 MTP
    assert (kv["deepseek4.expert_count"], kv["deepseek4.expert_used_count"]) == (256, 6)
    assert kv["deepseek4.expert_shared_count"] == 1
    assert kv["deepseek4.hyper_connection.count"] == 4
    assert kv["deepseek4.hash_layer_count"] == 3
    ratios = spec.compress_ratios()
    assert len(ratios) == 44 and ratios[:2] == [0, 0] and {4, 128} <= set(ratios)
    expert_bytes = 3 * spec.n_embd * spec.n_ff_exp * spec.n_expert * 2 * 44
    assert expert_bytes < 300 << 20


def test_split_chains_equal_the_whole_model_bit_for_bit(quick_twin: Path) -> None:
    structure = ModelStructure(SPEC.n_layer, SPEC.hash_layers, tuple(SPEC.compress_ratios()))
    tokens, ref_logits, ref_tokens = reference_run(quick_twin, 4, prompt())
    for scenario in generate(structure, [2, 3, SPEC.n_layer]):
        result = compare(quick_twin, scenario.layout, "f32", tokens, ref_logits, ref_tokens)
        assert result.bitwise_equal, scenario
        assert result.boundary_bytes_per_token == 4 * 64 * 4


def test_bad_v4_input_gets_typed_errors(engine_module: ModuleType, quick_twin: Path) -> None:
    path = str(quick_twin)
    middle = engine_module.Engine(path, 1, 4, **OPTS)  # owns hash-routed layers 1 and 2
    d = middle.describe()
    assert (d["hc"], d["n_embd"], d["needs_token_ids"], d["hash_layers"]) == (4, 64, True, 3)
    ids = prompt(3)
    with pytest.raises(ValueError, match=r"\[n_tokens, 256\]"):
        middle.forward(1, 1, 0, tokens=ids, boundary=np.zeros((3, 64), np.float32))
    with pytest.raises(engine_module.ShardError, match="token-ID sideband") as info:
        middle.forward(1, 1, 0, boundary=np.zeros((3, 256), np.float32))
    assert info.value.status == "invalid_argument"
    # a stage past the hash-routed block needs no sideband
    late = engine_module.Engine(path, 4, SPEC.n_layer, **OPTS)
    assert not late.describe()["needs_token_ids"]
    assert late.forward(1, 1, 0, boundary=np.zeros((3, 256), np.float32)).shape == (1, SPEC.n_vocab)
    # the failed requests left nothing behind: the session starts clean
    assert middle.sessions() == []
    assert middle.forward(1, 1, 0, tokens=ids, boundary=np.zeros((3, 256), np.float32)).shape == (
        3,
        256,
    )


def test_v4_state_exists_for_owned_layers_only(engine_module: ModuleType, quick_twin: Path) -> None:
    path = str(quick_twin)
    whole = engine_module.Engine(path, **OPTS).describe()
    stages = [
        engine_module.Engine(path, a, b, **OPTS).describe() for a, b in [(0, 2), (2, 4), (4, 6)]
    ]
    assert sum(s["weight_bytes"] for s in stages) == whole["weight_bytes"]
    assert sum(s["kv_bytes"] for s in stages) == whole["kv_bytes"]
    # [0, 2) is SWA only; [2, 4) adds CSA, indexer and HCA caches and compressor state
    assert 0 < stages[0]["kv_bytes"] < stages[1]["kv_bytes"]


def test_a_new_epoch_starts_v4_state_from_scratch(
    engine_module: ModuleType, quick_twin: Path
) -> None:
    path = str(quick_twin)
    head = engine_module.Engine(path, 0, 3, **OPTS)
    tail = engine_module.Engine(path, 3, SPEC.n_layer, **OPTS)
    ids = prompt(150)

    def run(epoch: int) -> np.ndarray:
        x = head.forward(7, epoch, 0, tokens=ids)
        first = tail.forward(7, epoch, 0, boundary=x)
        step = np.array([int(np.argmax(first[-1]))], np.int32)
        nxt = tail.forward(
            7, epoch, len(ids), boundary=head.forward(7, epoch, len(ids), tokens=step)
        )
        return np.concatenate([first[-1], nxt[-1]])

    first = run(1)
    with pytest.raises(engine_module.ShardError) as info:
        tail.forward(7, 1, 0, boundary=head.forward(8, 1, 0, tokens=ids))
    assert info.value.status == "cache_mismatch"
    assert np.array_equal(run(2).view(np.uint32), first.view(np.uint32))


def test_v4_state_is_kept_per_session(engine_module: ModuleType, quick_twin: Path) -> None:
    path = str(quick_twin)

    def chain() -> list[object]:
        return [engine_module.Engine(path, 0, 2, **OPTS), engine_module.Engine(path, 2, 6, **OPTS)]

    def step(engines: list[object], session: int, n_past: int, ids: np.ndarray) -> np.ndarray:
        head, tail = engines
        x = head.forward(session, 1, n_past, tokens=ids)  # type: ignore[attr-defined]
        out: np.ndarray = tail.forward(session, 1, n_past, tokens=ids, boundary=x)  # type: ignore[attr-defined]
        return out[-1].copy()

    prompts = {1: prompt(140, seed=11), 2: prompt(170, seed=12)}
    alone = {}
    for session, ids in prompts.items():
        engines = chain()
        alone[session] = [step(engines, session, 0, ids)]
        alone[session].append(step(engines, session, len(ids), ids[:1]))
    shared = chain()
    together: dict[int, list[np.ndarray]] = {
        s: [step(shared, s, 0, ids)] for s, ids in prompts.items()
    }
    for session, ids in prompts.items():
        together[session].append(step(shared, session, len(ids), ids[:1]))
    for session in prompts:
        a, b = np.stack(alone[session]), np.stack(together[session])
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
