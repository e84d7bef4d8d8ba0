"""The seed's DeepSeek V4 target identities are registered, the pin records how it relates to
the llama.cpp merge V4 support began with, and a generated twin is told apart from the target by
name (its revision and its sizes), while the architecture fields it shares pass."""

from __future__ import annotations

from pathlib import Path

from dgr_artifacts.identity import open_model
from dgr_artifacts.targets import TARGETS, check

SEED = Path(__file__).resolve().parents[3].parent / "shared" / "seed" / "README.md"


def test_the_v4_target_carries_the_seeds_identities() -> None:
    v4 = TARGETS["deepseek-v4"]
    if SEED.is_file():  # beside the checkout (CI copies ../shared); the identities are the seed's
        seed = SEED.read_text(encoding="utf-8")
        assert v4.revision in seed and v4.llama_cpp_merge in seed
        assert f"PR {v4.llama_cpp_pr}" in seed


def test_the_pin_names_its_relation_to_the_v4_merge() -> None:
    from dgr_llamacpp.manifest import load_pin

    root = Path(__file__).resolve().parents[3]
    pin = load_pin(root / "native" / "llama.cpp" / "manifest.json")
    [lineage] = [entry for entry in pin.lineage if entry.arch == "deepseek4"]
    assert lineage.merge == TARGETS["deepseek-v4"].llama_cpp_merge
    assert lineage.pull_request == TARGETS["deepseek-v4"].llama_cpp_pr
    # "descendant" rests on the tree carrying the arch, which fetch verifies (required_archs)
    assert lineage.relation != "descendant" or "deepseek4" in pin.required_archs


def test_a_twin_is_not_the_target_and_says_why() -> None:
    from dgr_artifacts.models import model_path

    twin = open_model(model_path("dsv4-twin-quick"))
    v4 = TARGETS["deepseek-v4"]
    problems = check(v4, twin, None)
    fields = {p.split(":")[0] for p in problems}
    assert "revision" in fields and "deepseek4.embedding_length" in fields
    assert "deepseek4.block_count" in fields  # 6 main layers and MTP, not 43 and MTP
    # what the twin shares with V4 by construction passes
    for same in ("hyper_connection.count", "expert_used_count", "hash_layer_count"):
        assert f"deepseek4.{same}" not in fields
    assert check(v4, twin, v4.revision)[0].startswith("deepseek4.")  # revision fine, sizes not
