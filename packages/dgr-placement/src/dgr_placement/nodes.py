"""What `dgr plan --nodes nodes.yaml` reads: the nodes (memory, threads, compute per layer from a
probe) and the links between them (one-way latency and bandwidth, from row to column).

    nodes:
      - {name: a, listen: "10.0.0.1:7001", memory_mib: 8192, threads: 8,
         compute: {ms_per_layer: 0.41, head_ms: 0.2, tail_ms: 1.9}}   # from `dgr plan probe`
      - {name: b, listen: "10.0.0.2:7001", memory_mib: 4096, threads: 4}  # no compute: probed
    links:
      latency_ms: [[0, 12], [12, 0]]
      mbps: [[0, 100], [100, 0]]     # optional: absent means latency only
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import yaml
from dgr_artifacts.recipe import Name
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

# a port in 1..65535, spelled out so that the schema says it too (a worker refuses 99999, which
# getaddrinfo would take modulo 2**16)
PORT = r"(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
Listen = Annotated[str, StringConstraints(pattern=rf"^[A-Za-z0-9._\[\]:-]{{1,255}}:{PORT}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Compute(_Strict):
    """Time per decode token on this node, at its threads (`dgr plan probe` measures it)."""

    ms_per_layer: float = Field(gt=0, le=1e5, description="a mean block layer")
    head_ms: float = Field(default=0.0, ge=0, le=1e5, description="the embedding, at the head")
    tail_ms: float = Field(default=0.0, ge=0, le=1e5, description="norm and output, at the tail")
    stage_ms: float = Field(
        default=0.0, ge=0, le=1e5, description="fixed per stage: taking and handing on a boundary"
    )


class Node(_Strict):
    name: Name
    listen: Listen = Field(description="where its worker listens (HOST:PORT)")
    memory_mib: float = Field(gt=0, le=2**30, description="memory the worker may use")
    threads: int = Field(ge=1, le=1024)
    compute: Compute | None = Field(default=None, description="absent: probed on this machine")

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_mib * 2**20)


Matrix = list[list[float]]


class Links(_Strict):
    latency_ms: Matrix = Field(description="one-way latency from row node to column node")
    mbps: Matrix | None = Field(default=None, description="bandwidth in Mbit/s; absent: unlimited")


class NodesFile(_Strict):
    nodes: list[Node] = Field(min_length=1, max_length=64)
    links: Links

    @model_validator(mode="after")
    def _consistent(self) -> NodesFile:
        names = [n.name for n in self.nodes]
        for n in names:
            if names.count(n) > 1:
                raise ValueError(f"node name {n!r} appears more than once")
        size = len(self.nodes)
        for label, matrix, positive in (
            ("latency_ms", self.links.latency_ms, False),
            ("mbps", self.links.mbps, True),
        ):
            if matrix is None:
                continue
            if len(matrix) != size or any(len(row) != size for row in matrix):
                raise ValueError(f"links.{label} must be {size} x {size} (one row per node)")
            for i, row in enumerate(matrix):
                for j, v in enumerate(row):
                    bad = not math.isfinite(v) or v < 0 or (positive and i != j and v <= 0)
                    if bad or v > 1e9:
                        raise ValueError(
                            f"links.{label}[{names[i]}][{names[j]}] = {v} is out of range"
                        )
        return self

    def hop_ms(self, i: int, j: int, nbytes: int) -> float:
        """One message of `nbytes` from node i to node j: latency plus serialization."""
        if i == j:
            return 0.0
        ms = self.links.latency_ms[i][j]
        if self.links.mbps is not None:
            ms += nbytes * 8 / (self.links.mbps[i][j] * 1e6) * 1000
        return ms


def load_nodes(path: Path) -> NodesFile:
    """The nodes file at `path`; ValueError (a pydantic ValidationError among them) or OSError
    says what is wrong with it."""
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"not YAML: {getattr(exc, 'problem', None) or exc}{where}") from None
    return NodesFile.model_validate(document)


def schema_models() -> dict[str, type[BaseModel]]:
    return {"placement-nodes.schema.json": NodesFile}
