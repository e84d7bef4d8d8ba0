"""Even layouts of a model's layers, and a chain of engines over them in one process: the
single-process reference a route is compared with (the demo's parity check, the certification
harness), computed by the same engine the workers run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dgr_route.engine import locate

ENGINE_OPTIONS: dict[str, int] = {"n_threads": 2, "n_ctx": 512, "n_batch": 512, "max_sessions": 1}


def even_layout(n_layer: int, n_stages: int) -> list[tuple[int, int]]:
    """`n_stages` contiguous ranges of as equal size as integers allow."""
    bounds = [round(i * n_layer / n_stages) for i in range(n_stages + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(n_stages)]


class Chain:
    """Engines over consecutive ranges, driven as one model (session 1, epoch 1)."""

    def __init__(
        self, model: Path, layout: Sequence[tuple[int, int]], boundary_dtype: str = "f32"
    ) -> None:
        engine = locate().module()
        self.engines = [engine.Engine(str(model), a, b, **ENGINE_OPTIONS) for a, b in layout]
        # the token-ID sideband goes to stages that own a hash-routed layer (DeepSeek V4)
        self.sideband = [bool(e.describe()["needs_token_ids"]) for e in self.engines]
        self.dtype = boundary_dtype
        self.n_past = 0

    def step(self, tokens: np.ndarray) -> np.ndarray:
        x: np.ndarray | None = None
        for e, sideband in zip(self.engines, self.sideband, strict=True):
            if x is None:
                x = e.forward(1, 1, self.n_past, tokens=tokens, out_dtype=self.dtype)
            else:
                ids = tokens if sideband else None
                x = e.forward(1, 1, self.n_past, tokens=ids, boundary=x, out_dtype=self.dtype)
        self.n_past += len(tokens)
        assert x is not None
        last: np.ndarray = x[-1]
        return last

    def greedy(self, prompt: np.ndarray, steps: int) -> tuple[list[np.ndarray], list[int]]:
        """`steps` logits rows, each choosing the next token greedily from the one before:
        the prompt's, then one per generated token (what a route does)."""
        logits = [self.step(prompt)]
        tokens = [int(np.argmax(logits[0]))]
        while len(logits) < steps:
            logits.append(self.step(np.array([tokens[-1]], dtype=np.int32)))
            tokens.append(int(np.argmax(logits[-1])))
        return logits, tokens

    def tokenize(self, text: str) -> np.ndarray:
        return np.asarray(self.engines[0].tokenize(text, True), dtype=np.int32)

    def boundary_bytes_per_token(self) -> int:
        d = self.engines[0].describe()
        return int(d["hc"] * d["n_embd"] * (4 if self.dtype == "f32" else 2))
