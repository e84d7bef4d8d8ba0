"""The placement planner (DGR-057): contiguous layer ranges over heterogeneous nodes.

A plan is a sequence of distinct nodes, each serving one contiguous range, in layer order. Its
predicted time per decode token is what a token costs on the forward data plane's ring:

    sum over stages of compute(node, range)       (probed ms per layer x the layers' weights,
                                                   + embedding at the head, output at the tail)
  + sum over seams of hop(node -> next node)      (latency + boundary bytes / bandwidth)
  + hop(tail -> head) for the sampled token       (none when one node serves everything)

which is the seam-cost model of DGR-053 with the forward mode's one hop per seam. A stage fits a
node when its estimate (weights + KV + compute buffers + the worker's overhead, `profile`) times
(1 + margin) is at most the node's memory. The second objective is aggregate throughput: among
plans within `TIE` of the best time, the one whose slowest stage is fastest.

Search: for a fixed node order, dynamic programming over (position, layers covered) is exact.
Up to `EXACT_NODES` nodes, a dynamic program over (set of nodes used, last node, layers covered)
for each head covers every order and every subset of nodes, so it is exhaustive over orders.
Beyond that, orders come from a heuristic (speed, memory and nearest-neighbour orders improved
by swaps and moves, each order solved exactly) and the plan reports its gap to a lower bound.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from dgr_placement.nodes import Compute, NodesFile
from dgr_placement.profile import TOKEN_MESSAGE_BYTES, ModelProfile

EXACT_NODES = 8
RESTARTS = 3  # local searches, from the best starting orders
TIE = 0.005  # plans within 0.5% of the best time count as equally fast
DEFAULT_MARGIN = 0.15  # bench-memory bounds RSS by 1.15 x the estimate (plus the overhead)
INF = float("inf")
EPS = 1e-9  # relative: equal times within rounding


class NoPlan(ValueError):
    """No placement fits: says how much memory the model needs against what the nodes have."""


@dataclass(frozen=True)
class Stage:
    node: int
    first: int
    last: int
    compute_ms: float
    memory_bytes: int
    hop_ms: float  # to the next stage (the tail: its token to the head)


@dataclass(frozen=True)
class Plan:
    stages: tuple[Stage, ...]
    latency_ms: float
    bottleneck_ms: float
    lower_bound_ms: float
    exact: bool

    @property
    def tok_s(self) -> float:
        return 1000.0 / self.latency_ms

    @property
    def throughput_tok_s(self) -> float:
        return 1000.0 / self.bottleneck_ms

    @property
    def gap(self) -> float:
        """Over the lower bound (0 when the plan is proven optimal)."""
        return 0.0 if self.exact else self.latency_ms / self.lower_bound_ms - 1.0


class Problem:
    """Costs of every (node, range) and every hop, as matrices the searches share."""

    def __init__(
        self,
        profile: ModelProfile,
        nodes: NodesFile,
        computes: list[Compute],
        wire_dtype: str = "f32",
        margin: float = DEFAULT_MARGIN,
    ) -> None:
        if not 0 <= margin < 10:
            raise ValueError(f"memory margin {margin} is not in [0, 10)")
        self.profile, self.nodes, self.computes, self.margin = profile, nodes, computes, margin
        n, size = profile.n_layer, len(nodes.nodes)
        self.n_layer, self.size = n, size
        a = np.arange(n + 1)[:, None]
        b = np.arange(n + 1)[None, :]
        valid = a < b
        weight = np.concatenate([[0.0], np.cumsum(profile.layer_weights())])
        span = weight[None, :] - weight[:, None]
        head, tail = a == 0, b == n
        # what a worker over each range holds: the profile's estimator, one source for both
        self.memory = np.full((n + 1, n + 1), INF)
        for first in range(n):
            for last in range(first + 1, n + 1):
                self.memory[first, last] = profile.stage_bytes(first, last)
        self.cost = np.empty((size, n + 1, n + 1))
        for i, (node, comp) in enumerate(zip(nodes.nodes, computes, strict=True)):
            ms = (
                comp.ms_per_layer * span + head * comp.head_ms + tail * comp.tail_ms + comp.stage_ms
            )
            fits = self.memory * (1 + margin) <= node.memory_bytes
            self.cost[i] = np.where(valid & fits, ms, INF)
        boundary = profile.boundary_bytes[wire_dtype]
        self.hop = np.array(
            [[nodes.hop_ms(i, j, boundary) for j in range(size)] for i in range(size)]
        )
        self.ring = np.array(
            [[nodes.hop_ms(i, j, TOKEN_MESSAGE_BYTES) for j in range(size)] for i in range(size)]
        )
        self.serialize = self.hop - np.array(nodes.links.latency_ms)  # bandwidth part only

    def evaluate(self, stages: list[tuple[int, int, int]]) -> tuple[float, float]:
        """(time per token, slowest stage) of (node, first, last) stages; inf if one won't fit."""
        latency, bottleneck = 0.0, 0.0
        for k, (node, first, last) in enumerate(stages):
            ms = float(self.cost[node, first, last])
            latency += ms
            bottleneck = max(bottleneck, ms)
            if k + 1 < len(stages):
                latency += self.hop[node, stages[k + 1][0]]
                bottleneck = max(bottleneck, self.serialize[node, stages[k + 1][0]])
        if len(stages) > 1:
            latency += self.ring[stages[-1][0], stages[0][0]]
        return latency, bottleneck

    def make_plan(self, stages: list[tuple[int, int, int]], exact: bool) -> Plan:
        latency, bottleneck = self.evaluate(stages)
        out = []
        for k, (node, first, last) in enumerate(stages):
            nxt = stages[(k + 1) % len(stages)][0]
            hop = (
                0.0
                if len(stages) == 1
                else (self.hop if k + 1 < len(stages) else self.ring)[node, nxt]
            )
            out.append(
                Stage(
                    node,
                    first,
                    last,
                    float(self.cost[node, first, last]),
                    int(self.memory[first, last]),
                    float(hop),
                )
            )
        return Plan(tuple(out), latency, bottleneck, lower_bound(self), exact)

    def no_plan(self) -> NoPlan:
        need = self.memory[0, self.n_layer] * (1 + self.margin)
        have = ", ".join(f"{n.name} {n.memory_mib:g} MiB" for n in self.nodes.nodes)
        return NoPlan(
            f"no placement fits in memory: one worker for the whole model needs "
            f"{need / 2**20:.1f} MiB with the {self.margin:.0%} margin, and no split over the "
            f"nodes fits either (they have {have})"
        )


Stages = list[tuple[int, int, int]]  # (node, first, last), in layer order


def _choose(problem: Problem, finals: list[tuple[float, Stages]]) -> Stages:
    best = min(f[0] for f in finals)
    if best == INF:
        raise problem.no_plan()
    near = [s for latency, s in finals if latency <= best * (1 + TIE)]
    return min(near, key=lambda s: problem.evaluate(s)[::-1])  # (slowest stage, time)


def _extend(
    problem: Problem, time: np.ndarray, slowest: np.ndarray, src: int, dst: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One more stage, on node dst after a stage on src, from every end of the layers covered
    to every new end: the least time, exact ties broken by the slowest stage. Returns (time,
    slowest stage, previous end) for each new end."""
    cost = problem.cost[dst]
    cand = (time + problem.hop[src, dst])[:, None] + cost
    worst = np.maximum(slowest[:, None], np.maximum(cost, problem.serialize[src, dst]))
    best = cand.min(0)
    arg = np.where(cand <= best * (1 + EPS), worst, INF).argmin(0)
    cols = np.arange(cand.shape[1])
    return cand[arg, cols], worst[arg, cols], arg


def _merge(
    into: tuple[np.ndarray, np.ndarray, np.ndarray],
    found: tuple[np.ndarray, np.ndarray, np.ndarray],
    src: int,
) -> None:
    """Keep, for each end, the better of what `into` holds and what `found` offers."""
    time, slowest, back = into
    val, worst, arg = found
    better = np.isfinite(val) & (
        (val < time * (1 - EPS)) | ((val <= time * (1 + EPS)) & (worst < slowest))
    )
    time[better], slowest[better] = val[better], worst[better]
    back[better] = np.stack([np.full(int(better.sum()), src), arg[better]], axis=1)


def _table(rows: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (
        np.full((rows, n + 1), INF),
        np.full((rows, n + 1), INF),
        np.full((rows, n + 1, 2), -1, dtype=np.int64),
    )


def plan_in_order(problem: Problem, order: list[int]) -> tuple[float, list[tuple[int, int, int]]]:
    """The best plan headed by order[0] whose other stages follow the order, any of them left
    out: exact, by dynamic programming over (position, layers covered)."""
    n, m, head = problem.n_layer, len(order), order[0]
    best: tuple[float, list[tuple[int, int, int]]] = (INF, [])
    time, slowest, back = _table(m, n)
    time[0] = slowest[0] = problem.cost[head, 0]
    for i in range(m):
        if not np.isfinite(time[i]).any():
            continue
        done = time[i, n] + (problem.ring[order[i], head] if i else 0.0)
        if done < best[0]:
            best = (float(done), _trace(order, back, i, n))
        for j in range(i + 1, m):
            found = _extend(problem, time[i], slowest[i], order[i], order[j])
            _merge((time[j], slowest[j], back[j]), found, i)
    return best


def _trace(order: list[int], back: np.ndarray, i: int, k: int) -> list[tuple[int, int, int]]:
    stages = []
    while True:
        prev_i, prev_k = back[i, k]
        if prev_i < 0:
            stages.append((order[i], 0, k))
            return stages[::-1]
        stages.append((order[i], int(prev_k), k))
        i, k = int(prev_i), int(prev_k)


def exact(problem: Problem) -> Plan:
    """Exhaustive over node orders and subsets: for each head, a dynamic program over (nodes
    used, last node, layers covered)."""
    n, size = problem.n_layer, problem.size
    finals: list[tuple[float, list[tuple[int, int, int]]]] = []
    for head in range(size):
        tables = {1 << head: _table(size, n)}
        tables[1 << head][0][head] = tables[1 << head][1][head] = problem.cost[head, 0]
        ends: list[tuple[float, int, int]] = []
        for mask in range(1 << size):
            if mask not in tables:
                continue
            time, slowest, _ = tables[mask]
            for last in range(size):
                if not mask >> last & 1 or not np.isfinite(time[last]).any():
                    continue
                ring = problem.ring[last, head] if mask != 1 << head else 0.0
                ends.append((float(time[last, n] + ring), mask, last))
                for j in range(size):
                    if mask >> j & 1:
                        continue
                    nxt = tables.setdefault(mask | 1 << j, _table(size, n))
                    found = _extend(problem, time[last], slowest[last], last, j)
                    _merge((nxt[0][j], nxt[1][j], nxt[2][j]), found, last)
        back = {mask: t[2] for mask, t in tables.items()}
        finals += [
            (latency, _trace_subset(back, mask, last, n, head))
            for latency, mask, last in ends
            if latency < INF
        ]
    if not finals:
        raise problem.no_plan()
    return problem.make_plan(_choose(problem, finals), exact=True)


def _trace_subset(back: dict[int, np.ndarray], mask: int, last: int, k: int, head: int) -> Stages:
    stages: list[tuple[int, int, int]] = []
    while mask != 1 << head:
        prev_last, prev_k = (int(x) for x in back[mask][last, k])
        stages.append((last, prev_k, k))
        mask, last, k = mask & ~(1 << last), prev_last, prev_k
    stages.append((head, 0, k))
    return stages[::-1]


def heuristic(problem: Problem, max_evaluations: int = 600) -> Plan:
    """Orders by speed, by memory and by nearest link from each node, then swaps and moves while
    they help; each order solved exactly by `plan_in_order`."""
    size = problem.size
    speed = sorted(range(size), key=lambda i: problem.computes[i].ms_per_layer)
    memory = sorted(range(size), key=lambda i: -problem.nodes.nodes[i].memory_mib)
    starts = [speed, memory]
    for first in range(size):
        tour, left = [first], set(range(size)) - {first}
        while left:
            nxt = min(left, key=lambda j: problem.hop[tour[-1], j])
            tour.append(nxt)
            left.remove(nxt)
        starts.append(tour)
    scored = sorted(
        ((plan_in_order(problem, order), order) for order in starts), key=lambda s: s[0][0]
    )
    evaluations = len(scored)
    best = scored[0][0]
    for found, start in scored[:RESTARTS]:
        result, evaluations = _improve(problem, found, start, evaluations, max_evaluations)
        if result[0] < best[0]:
            best = result
    if best[0] == INF:
        raise problem.no_plan()
    return problem.make_plan(best[1], exact=False)


def _improve(
    problem: Problem,
    found: tuple[float, list[tuple[int, int, int]]],
    order: list[int],
    evaluations: int,
    budget: int,
) -> tuple[tuple[float, list[tuple[int, int, int]]], int]:
    """Swaps and moves of the order while one helps (first improvement), within the budget."""
    size = problem.size
    swaps = [("swap", i, j) for i, j in itertools.combinations(range(size), 2)]
    moves = [("move", i, j) for i, j in itertools.permutations(range(size), 2)]
    improved = True
    while improved and evaluations < budget:
        improved = False
        for kind, i, j in swaps + moves:
            if evaluations >= budget:
                break
            candidate = order.copy()
            if kind == "swap":
                candidate[i], candidate[j] = candidate[j], candidate[i]
            else:
                candidate.insert(j, candidate.pop(i))
            result = plan_in_order(problem, candidate)
            evaluations += 1
            if result[0] < found[0] * (1 - 1e-9):
                found, order, improved = result, candidate, True
    return found, evaluations


def lower_bound(problem: Problem) -> float:
    """No plan is faster: each layer on the fastest node that could hold that many layers
    (heaviest layers on the fastest nodes, which is optimal for the relaxation), the cheapest
    head, tail and stage costs, and the cheapest links of the fewest stages memory allows."""
    n = problem.n_layer
    caps = []
    for i in range(problem.size):
        fits = np.isfinite(problem.cost[i])
        spans = np.where(fits, np.arange(n + 1)[None, :] - np.arange(n + 1)[:, None], 0)
        caps.append(int(spans.max()))
    if max(caps) == 0:
        return INF
    weights = sorted(problem.profile.layer_weights(), reverse=True)
    by_speed = sorted(range(problem.size), key=lambda i: problem.computes[i].ms_per_layer)
    total, layer = 0.0, 0
    for i in by_speed:
        take = min(caps[i], n - layer)
        total += problem.computes[i].ms_per_layer * sum(weights[layer : layer + take])
        layer += take
    if layer < n:
        return INF
    stages, covered = 0, 0
    for cap in sorted(caps, reverse=True):
        if covered >= n:
            break
        stages, covered = stages + 1, covered + cap
    total += min(c.head_ms for c in problem.computes) + min(c.tail_ms for c in problem.computes)
    total += stages * min(c.stage_ms for c in problem.computes)
    if stages > 1:
        off = ~np.eye(problem.size, dtype=bool)
        total += (stages - 1) * problem.hop[off].min() + problem.ring[off].min()
    return float(total)


def plan(problem: Problem) -> Plan:
    return exact(problem) if problem.size <= EXACT_NODES else heuristic(problem)
