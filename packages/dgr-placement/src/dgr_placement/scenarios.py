"""Generated placement scenarios: heterogeneous nodes (memory, speed, threads) and link matrices
drawn from a seed, sized so that the model needs a given number of stages at least. Tests and
the end-to-end bench take their instances from here, never from constants."""

from __future__ import annotations

import numpy as np

from dgr_placement.nodes import Compute, Links, Node, NodesFile
from dgr_placement.profile import ModelProfile, WorkerOptions

MIB = 2**20


def synthetic_profile(rng: np.random.Generator, n_layer: int) -> ModelProfile:
    """A model of `n_layer` layers with uneven layer sizes (as gemma3's sliding and global
    layers are), an embedding and an output head."""
    layers = [int(x) for x in rng.integers(20, 40, n_layer) * MIB]
    return ModelProfile(
        model_fingerprint="0" * 64,
        manifest_sha256="0" * 64,
        n_layer=n_layer,
        options=WorkerOptions(),
        layer_weight_bytes=layers,
        shared_weight_bytes=int(rng.integers(0, 2)) * MIB,
        head_weight_bytes=int(rng.integers(30, 120)) * MIB,
        tail_weight_bytes=int(rng.integers(30, 120)) * MIB,
        tied_output=bool(rng.integers(0, 2)),
        layer_kv_bytes=[int(rng.integers(1, 8)) * MIB] * n_layer,
        compute_bytes={"head": 14 * MIB, "middle": 13 * MIB, "tail": 100 * MIB, "whole": 102 * MIB},
        overhead_bytes=70 * MIB,
        boundary_bytes={"f32": 4096 * 4 + 60, "f16": 4096 * 2 + 60, "bf16": 4096 * 2 + 60},
    )


def nodes_for(
    rng: np.random.Generator, profile: ModelProfile, n_nodes: int, min_stages: int
) -> NodesFile:
    """`n_nodes` nodes whose memory makes `min_stages` the fewest stages that can hold the model
    (each node holds at most about 1/min_stages of it), differing in speed and links."""
    if not 1 <= min_stages <= n_nodes:
        raise ValueError(f"{min_stages} stages need 1..{n_nodes} nodes")
    layer = (sum(profile.layer_weight_bytes) + sum(profile.layer_kv_bytes)) / profile.n_layer
    fixed = profile.overhead_bytes + profile.shared_weight_bytes + profile.compute_bytes["middle"]
    ends = max(profile.head_weight_bytes, profile.tail_weight_bytes) + max(
        profile.compute_bytes.values()
    )
    nodes = []
    for i in range(n_nodes):
        share = profile.n_layer / min_stages * float(rng.uniform(0.85, 1.0))
        memory = (layer * share + fixed + (ends if i < 2 else 0)) * 1.15
        threads = int(rng.choice([1, 2, 4, 8]))
        nodes.append(
            Node(
                name=f"n{i}",
                listen=f"10.0.{i // 250}.{i % 250 + 1}:7000",
                memory_mib=round(memory / MIB + 1, 1),
                threads=threads,
                compute=Compute(
                    ms_per_layer=round(float(rng.uniform(0.2, 2.0)) * 4 / threads, 3),
                    head_ms=round(float(rng.uniform(0.0, 0.5)), 3),
                    tail_ms=round(float(rng.uniform(0.5, 3.0)), 3),
                    stage_ms=round(float(rng.uniform(0.0, 0.3)), 3),
                ),
            )
        )
    order = rng.permutation(n_nodes)  # the two nodes that can hold an end anywhere in the list
    nodes = [nodes[i] for i in order]
    site = rng.integers(0, max(1, n_nodes // 3), n_nodes)  # nodes in a site are close
    latency = [
        [
            0.0
            if i == j
            else round(
                float(rng.uniform(0.1, 1.0) if site[i] == site[j] else rng.uniform(5.0, 40.0)), 2
            )
            for j in range(n_nodes)
        ]
        for i in range(n_nodes)
    ]
    mbps = [
        [0.0 if i == j else float(rng.choice([100.0, 1000.0, 10000.0])) for j in range(n_nodes)]
        for i in range(n_nodes)
    ]
    return NodesFile(nodes=nodes, links=Links(latency_ms=latency, mbps=mbps))


def scenario(
    seed: int, n_nodes: int, n_layer: int, min_stages: int
) -> tuple[ModelProfile, NodesFile]:
    rng = np.random.default_rng(seed)
    profile = synthetic_profile(rng, n_layer)
    return profile, nodes_for(rng, profile, n_nodes, min_stages)
