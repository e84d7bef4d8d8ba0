"""Models DGR targets that no package index here carries, by their upstream identities: what
provisioning checks a real download against before any stage serves it.

DeepSeek V4 is the seed's target (its official checkpoint revision and the llama.cpp merge its
support began with; native/llama.cpp/manifest.json says how the pin relates to that merge). No V4
weights exist on these machines: the generated twins (dgr_native.twins) have its architecture at
a small size, and `check` tells them apart from the target by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from dgr_artifacts.identity import GgufModel


@dataclass(frozen=True)
class Target:
    name: str
    source: str  # where the official weights come from, in words
    revision: str  # the official checkpoint's commit (40 hex digits)
    llama_cpp_merge: str  # the llama.cpp merge its support began with
    llama_cpp_pr: int
    arch: str
    # GGUF metadata the converted checkpoint must carry, without the "<arch>." prefix
    metadata: tuple[tuple[str, int], ...]


TARGETS = {
    t.name: t
    for t in [
        Target(
            name="deepseek-v4",
            source="DeepSeek's official V4 checkpoint, converted to split GGUF",
            revision="60d8d70770c6776ff598c94bb586a859a38244f1",
            llama_cpp_merge="8c146a8366304c871efc26057cc90370ccf58dad",
            llama_cpp_pr=24162,
            arch="deepseek4",
            metadata=(
                ("block_count", 44),  # 43 main layers and the MTP block
                ("nextn_predict_layers", 1),
                ("embedding_length", 4096),
                ("hyper_connection.count", 4),  # the mHC 4 x 4096 boundary
                ("expert_count", 256),
                ("expert_shared_count", 1),
                ("expert_used_count", 6),
                ("hash_layer_count", 3),  # token ids needed by the first three layers
            ),
        )
    ]
}


def check(target: Target, model: GgufModel, revision: str | None) -> list[str]:
    """What keeps `model` (downloaded at `revision`, None: unknown) from being `target`, each
    problem naming the field, what it is and what the target has; empty: it is the target."""
    problems = []
    if revision != target.revision:
        problems.append(f"revision: {revision or 'unknown'}, the target is {target.revision}")
    if model.arch != target.arch:
        problems.append(f"general.architecture: {model.arch}, the target is {target.arch}")
        return problems
    kv = model.hparams()
    for key, want in target.metadata:
        got = kv.get(f"{target.arch}.{key}")
        if got is None or int(got) != want:
            problems.append(f"{target.arch}.{key}: {got}, the target has {want}")
    return problems
