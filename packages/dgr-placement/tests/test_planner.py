"""DGR-057: the placement planner over generated scenarios (never constants): exact against brute
force on small instances, exhaustive up to 8 nodes, a heuristic with its gap to a lower bound on
10+ stages; every stage fits its node with the margin; the memory model agrees with llama.cpp's
own dry run on the real model; `dgr plan` prints the table, the worker commands and the route."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from dgr_artifacts.manifest import build_manifest
from dgr_artifacts.recipe import Recipe
from dgr_artifacts.subset import range_subset
from dgr_placement import planner
from dgr_placement.nodes import Compute, Links, Node, NodesFile
from dgr_placement.profile import ModelProfile, WorkerOptions, profile_model
from dgr_placement.scenarios import scenario
from pydantic import ValidationError

SMALL = [(seed, 2 + seed % 3, 5 + seed % 4, 1 + seed % 3) for seed in range(24)]


def problem_of(seed: int, n_nodes: int, n_layer: int, stages: int) -> planner.Problem:
    profile, nodes = scenario(seed, n_nodes, n_layer, stages)
    return planner.Problem(profile, nodes, [n.compute for n in nodes.nodes if n.compute])


def brute_force(p: planner.Problem) -> float:
    """Every sequence of distinct nodes, every cut of the layers among them."""
    best = planner.INF
    for m in range(1, p.size + 1):
        for seq in itertools.permutations(range(p.size), m):
            for cuts in itertools.combinations(range(1, p.n_layer), m - 1):
                bounds = [0, *cuts, p.n_layer]
                stages = [(seq[i], bounds[i], bounds[i + 1]) for i in range(m)]
                best = min(best, p.evaluate(stages)[0])
    return best


def assert_valid(p: planner.Problem, plan: planner.Plan) -> None:
    assert plan.stages[0].first == 0 and plan.stages[-1].last == p.n_layer
    for a, b in itertools.pairwise(plan.stages):
        assert a.last == b.first
    assert len({s.node for s in plan.stages}) == len(plan.stages)
    for s in plan.stages:
        assert s.memory_bytes == p.profile.stage_bytes(s.first, s.last)
        assert s.memory_bytes * (1 + p.margin) <= p.nodes.nodes[s.node].memory_bytes
    assert plan.latency_ms == pytest.approx(
        p.evaluate([(s.node, s.first, s.last) for s in plan.stages])[0]
    )
    assert plan.lower_bound_ms <= plan.latency_ms + 1e-9


@pytest.mark.parametrize(("seed", "n_nodes", "n_layer", "stages"), SMALL)
def test_exact_and_in_order_match_brute_force(
    seed: int, n_nodes: int, n_layer: int, stages: int
) -> None:
    p = problem_of(seed, n_nodes, n_layer, stages)
    best = brute_force(p)
    assert best < planner.INF  # the generator sizes nodes so that a plan exists
    plan = planner.exact(p)
    assert_valid(p, plan)
    # the first objective exactly; within TIE, the faster slowest stage wins
    assert best - 1e-9 <= plan.latency_ms <= best * (1 + planner.TIE) + 1e-9
    in_orders = min(
        plan_in[0]
        for plan_in in map(
            lambda o: planner.plan_in_order(p, list(o)), itertools.permutations(range(p.size))
        )
    )
    assert in_orders == pytest.approx(best)
    assert planner.heuristic(p).latency_ms >= best - 1e-9


def test_the_second_objective_breaks_ties_by_the_slowest_stage() -> None:
    profile, nodes = scenario(5, 2, 6, 1)
    fast = Compute(ms_per_layer=1.0)
    twins = nodes.model_copy(
        update={
            "nodes": [
                n.model_copy(update={"compute": fast, "memory_mib": 1e5}) for n in nodes.nodes
            ],
            "links": Links(latency_ms=[[0, 0], [0, 0]]),
        }
    )
    p = planner.Problem(profile, twins, [fast, fast])
    plan = planner.exact(p)
    # with free links every split costs the same time; the split whose slower half is lightest
    # has the fastest stage, and that is the one chosen
    weights = profile.layer_weights()
    lightest = min(max(sum(weights[:k]), sum(weights[k:])) for k in range(1, len(weights)))
    assert len(plan.stages) == 2
    assert plan.bottleneck_ms == pytest.approx(lightest)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("n_nodes", "n_layer", "stages"), [(4, 24, 2), (6, 30, 3), (8, 40, 4)])
def test_two_to_four_stage_scenarios_are_exact(
    seed: int, n_nodes: int, n_layer: int, stages: int
) -> None:
    p = problem_of(100 + seed, n_nodes, n_layer, stages)
    plan = planner.plan(p)
    assert plan.exact and plan.gap == 0.0
    assert_valid(p, plan)
    assert len(plan.stages) >= stages  # the generator's nodes hold about 1/stages each
    heuristic = planner.heuristic(p)
    assert_valid(p, heuristic)
    assert heuristic.latency_ms >= plan.latency_ms * (1 - planner.TIE)


@pytest.mark.parametrize(
    ("seed", "n_nodes", "n_layer", "stages"), [(7, 12, 60, 10), (8, 16, 80, 12)]
)
def test_ten_plus_stage_scenarios_report_their_gap(
    seed: int, n_nodes: int, n_layer: int, stages: int
) -> None:
    p = problem_of(seed, n_nodes, n_layer, stages)
    plan = planner.plan(p)
    assert not plan.exact
    assert_valid(p, plan)
    assert len(plan.stages) >= 10
    assert 0 <= plan.gap < 3 and np.isfinite(plan.gap)
    assert plan.gap == pytest.approx(plan.latency_ms / plan.lower_bound_ms - 1)


def test_nothing_fits_names_every_node() -> None:
    profile, nodes = scenario(3, 3, 12, 2)
    tiny = nodes.model_copy(
        update={"nodes": [n.model_copy(update={"memory_mib": 50}) for n in nodes.nodes]}
    )
    p = planner.Problem(profile, tiny, [n.compute for n in tiny.nodes if n.compute])
    with pytest.raises(planner.NoPlan, match="no placement fits in memory") as info:
        planner.plan(p)
    assert all(f"n{i} 50 MiB" in str(info.value) for i in range(3))
    assert planner.lower_bound(p) == planner.INF


def test_the_margin_is_applied() -> None:
    profile, nodes = scenario(11, 3, 16, 2)
    computes = [n.compute for n in nodes.nodes if n.compute]
    loose_problem = planner.Problem(profile, nodes, computes, margin=0.0)
    loose = planner.plan(loose_problem)
    assert_valid(loose_problem, loose)
    strict = planner.Problem(profile, nodes, computes, margin=0.2)
    tight = planner.plan(strict)
    assert_valid(strict, tight)
    assert len(tight.stages) >= len(loose.stages)
    # these nodes hold no plan once every stage needs 50% beside its estimate
    with pytest.raises(planner.NoPlan, match="with the 50% margin"):
        planner.plan(planner.Problem(profile, nodes, computes, margin=0.5))
    with pytest.raises(ValueError, match="margin"):
        planner.Problem(profile, nodes, computes, margin=-0.1)


@pytest.mark.parametrize(
    ("links", "message"),
    [
        ({"latency_ms": [[0, 1], [1, 0], [1, 1]]}, "2 x 2"),
        ({"latency_ms": [[0, float("nan")], [1, 0]]}, "latency_ms"),
        ({"latency_ms": [[0, -1], [1, 0]]}, r"latency_ms\[a\]\[b\] = -1"),
        ({"latency_ms": [[0, 1], [1, 0]], "mbps": [[0, 0], [10, 0]]}, r"mbps\[a\]\[b\] = 0"),
    ],
)
def test_bad_links_are_refused_by_name(links: dict[str, object], message: str) -> None:
    nodes = [
        {"name": "a", "listen": "10.0.0.1:7000", "memory_mib": 512, "threads": 2},
        {"name": "b", "listen": "10.0.0.2:7000", "memory_mib": 512, "threads": 2},
    ]
    with pytest.raises(ValidationError, match=message):
        NodesFile.model_validate({"nodes": nodes, "links": links})


def test_bad_nodes_are_refused_by_name() -> None:
    node = {"name": "a", "listen": "10.0.0.1:7000", "memory_mib": 512, "threads": 2}
    links = {"latency_ms": [[0, 1], [1, 0]]}
    with pytest.raises(ValidationError, match="node name 'a' appears more than once"):
        NodesFile.model_validate({"nodes": [node, node], "links": links})
    with pytest.raises(ValidationError, match="memory_mib"):
        Node.model_validate({**node, "memory_mib": float("inf")})
    with pytest.raises(ValidationError, match="threads"):
        Node.model_validate({**node, "threads": 0})
    with pytest.raises(ValidationError, match="ms_per_layer"):
        Node.model_validate({**node, "compute": {"ms_per_layer": float("nan")}})
    for port in ("0", "65536", "99999", "080"):  # the worker would refuse it, or listen elsewhere
        with pytest.raises(ValidationError, match="listen"):
            Node.model_validate({**node, "listen": f"10.0.0.1:{port}"})
    for port in ("1", "7001", "59999", "65535"):
        assert Node.model_validate({**node, "listen": f"10.0.0.1:{port}"}).listen.endswith(port)


def test_plan_options_out_of_the_workers_ranges_are_named(
    smollm2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--n-ctx 0, --max-sessions 0 and --margin -1 or nan were tracebacks (pydantic's, the
    planner's ValueError), 2**24 x 256 the engine's ShardError after the model was hashed."""
    from dgr_cli import main

    path = tmp_path / "nodes.yaml"
    path.write_text(
        "nodes: [{name: a, listen: 'h:1', memory_mib: 500, threads: 1}]\n"
        "links: {latency_ms: [[0]]}\n",
        encoding="utf-8",
    )
    base = ["plan", "--nodes", str(path), "--model", str(smollm2)]
    for option, value, message in [
        ("--n-ctx", "0", "argument --n-ctx: '0' is not an integer in [8, 16777216]"),
        ("--max-sessions", "0", "argument --max-sessions: '0' is not an integer in [1, 4096]"),
        ("--margin", "-1", "argument --margin: '-1' is not a number in [0, 10)"),
        ("--margin", "nan", "argument --margin: 'nan' is not a number in [0, 10)"),
    ]:
        with pytest.raises(SystemExit) as done:
            main([*base, option, value])
        assert done.value.code == 2 and message in capsys.readouterr().err
    assert main([*base, "--n-ctx", str(2**24), "--max-sessions", "256"]) == 2
    assert "dgr plan: --n-ctx 16777216 x --max-sessions 256 is more KV cells" in (
        capsys.readouterr().err
    )


def test_a_nodes_file_with_problems_lists_each_by_its_field(
    smollm2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each problem as `where: what`, not pydantic's dump of the input with its links."""
    from dgr_cli import main

    path = tmp_path / "nodes.yaml"
    path.write_text(
        'nodes:\n  - {name: a, listen: "h:99999", memory_mib: -5, threads: 0}\n'
        "links: {latency_ms: [[0]]}\n",
        encoding="utf-8",
    )
    assert main(["plan", "--nodes", str(path), "--model", str(smollm2)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"dgr plan: {path}: 3 problems:\n  nodes.0.listen: String should match"
    ), err
    assert "\n  nodes.0.memory_mib: Input should be greater than 0\n" in err, err
    assert err.endswith("\n  nodes.0.threads: Input should be greater than or equal to 1\n"), err
    assert "pydantic.dev" not in err and "input_value" not in err, err
    path.write_text("nodes: [{name: a, listen: 'h:1', memory_mib: 5, threads: 1}]\n", "utf-8")
    assert main(["plan", "--nodes", str(path), "--model", str(smollm2)]) == 2
    assert capsys.readouterr().err == f"dgr plan: {path}: links: Field required\n"


def test_a_nodes_file_that_is_not_yaml_is_named(
    smollm2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was a yaml.ScannerError traceback."""
    from dgr_cli import main

    path = tmp_path / "nodes.yaml"
    path.write_text("nodes: [\n", encoding="utf-8")
    assert main(["plan", "--nodes", str(path), "--model", str(smollm2)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"dgr plan: {path}: not YAML: expected the node content, but found '<stream end>' at "
        "line 2, column 1\n"
    ), err


@pytest.fixture(scope="module")
def real_profile(smollm2: Path) -> ModelProfile:
    return profile_model(smollm2, build_manifest(smollm2), WorkerOptions(n_ctx=256, max_sessions=2))


@pytest.mark.fleet  # profile_model measures a worker's overhead
def test_the_memory_model_is_llama_cpps_dry_run(
    smollm2: Path, real_profile: ModelProfile, engine_module: object
) -> None:
    manifest = build_manifest(smollm2)
    n = manifest.n_layer
    rng = np.random.default_rng(0)
    ranges = [(0, n), (0, 1), (n - 1, n)] + [
        tuple(sorted(int(x) for x in rng.choice(n + 1, 2, replace=False))) for _ in range(6)
    ]
    for a, b in ranges:
        d = engine_module.Engine(  # type: ignore[attr-defined]
            str(smollm2), a, b, estimate_only=True, n_ctx=256, n_batch=512, max_sessions=2
        ).describe()
        assert real_profile.weights(a, b) == range_subset(manifest, a, b).total_bytes
        assert real_profile.weights(a, b) == pytest.approx(d["weight_bytes"], rel=1e-3)
        estimate = d["weight_bytes"] + d["kv_bytes"] + d["compute_bytes"]
        assert real_profile.stage_bytes(a, b) - real_profile.overhead_bytes == pytest.approx(
            estimate, rel=0.01
        ), (a, b)
    assert 10 * 2**20 < real_profile.overhead_bytes < 500 * 2**20


@pytest.mark.fleet  # dgr plan profiles the model with a worker
def test_dgr_plan_prints_the_plan_and_writes_a_recipe(smollm2: Path, tmp_path: Path) -> None:
    compute = {"ms_per_layer": 0.5, "tail_ms": 1.6, "stage_ms": 1.5}
    nodes = {
        "nodes": [
            {
                "name": "big",
                "listen": "10.0.0.1:7001",
                "memory_mib": 220,
                "threads": 4,
                "compute": {**compute, "ms_per_layer": 0.25},
            },
            {
                "name": "small",
                "listen": "10.0.0.2:7001",
                "memory_mib": 150,
                "threads": 1,
                "compute": compute,
            },
            {
                "name": "far",
                "listen": "10.0.0.3:7001",
                "memory_mib": 150,
                "threads": 1,
                "compute": compute,
            },
        ],
        "links": {
            "latency_ms": [[0, 1, 40], [1, 0, 40], [40, 40, 0]],
            "mbps": [[0, 1000, 100], [1000, 0, 100], [100, 100, 0]],
        },
    }
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump(nodes))
    recipe_path = tmp_path / "recipe.json"
    base = [
        str(Path(sys.executable).parent / "dgr"),
        "plan",
        "--model",
        str(smollm2),
        "--nodes",
        str(path),
    ]
    out = subprocess.run(
        [*base, "--recipe-out", str(recipe_path), "--n-ctx", "256"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "exact: every node order and subset searched" in out
    assert "predicted" in out and "tok/s" in out
    # no node holds the whole model; only `big` holds a tail (its logits buffer), `small` takes
    # the head, and the node 40 ms away is left out
    assert "--route 10.0.0.2:7001,10.0.0.1:7001\n" in out
    assert "unused: far" in out
    assert f"dgr worker --model {smollm2} --recipe {recipe_path} --node small --listen" in out
    recipe = Recipe.model_validate_json(recipe_path.read_text())
    recipe.check(build_manifest(smollm2))
    assert [s.node for s in recipe.stages] == ["small", "big"]
    as_json = json.loads(
        subprocess.run(
            [*base, "--json", "--n-ctx", "256"], capture_output=True, text=True, check=True
        ).stdout
    )
    assert as_json["exact"] and as_json["recipe_id"] == recipe.id
    for stage in as_json["stages"]:
        assert stage["memory_bytes"] * 1.15 <= stage["node_memory_bytes"]

    nodes["nodes"] = [{**n, "memory_mib": 60} for n in nodes["nodes"]]
    path.write_text(yaml.safe_dump(nodes))
    failed = subprocess.run(base, capture_output=True, text=True)
    assert failed.returncode == 1
    assert "no placement fits in memory" in failed.stderr and "big 60 MiB" in failed.stderr
    path.write_text("nodes: []\nlinks: {latency_ms: []}\n")
    bad = subprocess.run(base, capture_output=True, text=True)
    assert bad.returncode == 2 and "nodes" in bad.stderr

    # a node without its compute is probed here: not at more threads than this machine has
    # cores (ggml's spinning barriers made that a silent wait of minutes), refused at once
    many = len(os.sched_getaffinity(0)) + 1
    del nodes["nodes"][0]["compute"]
    nodes["nodes"][0]["threads"] = many
    path.write_text(yaml.safe_dump(nodes))
    started = time.monotonic()
    refused = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused
    assert f"node 'big' has no compute: cannot probe {many} threads" in refused.stderr
    assert f"dgr plan --probe-threads {many}" in refused.stderr
    probe = subprocess.run(
        [*base[:4], "--probe-threads", str(many)], capture_output=True, text=True, timeout=120
    )
    assert probe.returncode == 2 and "cannot probe" in probe.stderr, probe
    assert time.monotonic() - started < 60


@pytest.mark.fleet  # dgr plan measures a worker's overhead where no earlier run stored it
def test_the_documented_nodes_file_plans(smollm2: Path, tmp_path: Path) -> None:
    """docs/usage.md's nodes.yaml, at `dgr plan`'s defaults (n_ctx 2048, 4 sessions), fits:
    node b's compute given (it would be probed here) so that only the memory model decides."""
    usage = (Path(__file__).parents[3] / "docs" / "usage.md").read_text()
    block = usage.split("```yaml\nnodes:", 1)[1].split("```", 1)[0]
    nodes = yaml.safe_load("nodes:" + block)
    nodes["nodes"][1]["compute"] = nodes["nodes"][0]["compute"]
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump(nodes))
    dgr = str(Path(sys.executable).parent / "dgr")
    out = subprocess.run(
        [dgr, "plan", "--model", str(smollm2), "--nodes", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "route: --route " in out.stdout
