"""`dgr plan`: place a model over heterogeneous nodes and print how to start it.

dgr plan --nodes nodes.yaml --model M [--recipe-out recipe.json] [--json]
dgr plan --probe-threads T --model M      (on each node: its compute line for nodes.yaml)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

MIB = 2**20


def margin(text: str) -> float:
    """An argparse type: the memory safety margin, a number in [0, 10)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < 10:  # NaN fails it too
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in [0, 10)")
    return value


def register(sub: Any) -> None:
    from dgr_cli.commands import integer

    p = sub.add_parser("plan", help="place a model's layers over nodes (memory, compute, links)")
    p.add_argument("--model", required=True, help="GGUF path or registered name")
    p.add_argument("--nodes", type=Path, help="nodes.yaml: nodes, memory, threads, links")
    p.add_argument(
        "--probe-threads", type=integer(1, 1024), help="measure this machine's compute and exit"
    )
    p.add_argument("--wire-dtype", default="f32", choices=["f32", "f16", "bf16"])
    p.add_argument("--margin", type=margin, default=None, help="memory safety margin (0.15)")
    # the workers' own bounds (dgr-shard-worker --n-ctx, --max-sessions)
    p.add_argument(
        "--n-ctx", type=integer(8, 2**24), default=2048, help="per session, as the workers run"
    )
    p.add_argument("--max-sessions", type=integer(1, 4096), default=4)
    p.add_argument("--name", help="the recipe's name (default: the model file's stem)")
    p.add_argument("--recipe-out", type=Path, help="write the plan as a recipe (JSON)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from dgr_artifacts.errors import problems
    from dgr_cli.commands import model_arg
    from pydantic import ValidationError

    from dgr_placement import planner
    from dgr_placement.nodes import load_nodes
    from dgr_placement.profile import ProbeError, probe

    model = model_arg(args.model)
    if args.probe_threads is not None:
        try:
            compute = probe(model, args.probe_threads)
        except ProbeError as exc:
            print(f"dgr plan: {exc}", file=sys.stderr)
            return 2
        print(
            f"compute: {json.dumps(compute.model_dump())}  # {model.name}, "
            f"{args.probe_threads} threads"
        )
        return 0
    if args.nodes is None:
        print("dgr plan: --nodes is required (or --probe-threads)", file=sys.stderr)
        return 2
    if args.n_ctx * args.max_sessions > 2**31 - 1:  # one llama context holds them (the engine)
        print(
            f"dgr plan: --n-ctx {args.n_ctx} x --max-sessions {args.max_sessions} is more KV "
            "cells than one llama.cpp context holds (2**31 - 1)",
            file=sys.stderr,
        )
        return 2
    try:
        nodes = load_nodes(args.nodes)
    except ValidationError as exc:
        print(f"dgr plan: {args.nodes}: {problems(exc)}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"dgr plan: {args.nodes}: {exc}", file=sys.stderr)
        return 2
    try:
        result = make_plan(model, nodes, args)
    except ProbeError as exc:
        print(f"dgr plan: {exc}", file=sys.stderr)
        return 2
    except planner.NoPlan as exc:
        print(f"dgr plan: {exc}", file=sys.stderr)
        return 1
    if args.recipe_out:
        from dgr_artifacts.recipe import write_recipe

        write_recipe(result["recipe"], args.recipe_out)
    if args.json:
        print(json.dumps(plan_json(result), indent=1))
    else:
        print(render(result, args))
    return 0


def make_plan(model: Path, nodes: Any, args: argparse.Namespace) -> dict[str, Any]:
    from dgr_artifacts.manifest import stored_manifest
    from dgr_artifacts.recipe import Recipe, StagePlacement, main_quantization
    from dgr_wire.ranges import LayerRange

    from dgr_placement import planner
    from dgr_placement.profile import ProbeError, WorkerOptions, check_probe, probe, profile_model

    unmeasured = [n for n in nodes.nodes if n.compute is None]
    for n in unmeasured:  # before anything is timed: every node this machine cannot stand for
        try:
            check_probe(n.threads)
        except ProbeError as exc:
            raise ProbeError(f"node {n.name!r} has no compute: {exc}") from None
    manifest = stored_manifest(model)
    options = WorkerOptions(n_ctx=args.n_ctx, max_sessions=args.max_sessions)
    profile = profile_model(model, manifest, options)
    probed: dict[int, Any] = {}  # by threads: nodes alike are probed once
    for n in unmeasured:
        if n.threads not in probed:
            print(
                f"dgr plan: probing this machine's compute at {n.threads} thread(s) for "
                f"{', '.join(m.name for m in unmeasured if m.threads == n.threads)} "
                "(its engines, then a 2-stage route of real workers)",
                file=sys.stderr,
                flush=True,
            )
            probed[n.threads] = probe(model, n.threads)
    computes = [n.compute or probed[n.threads] for n in nodes.nodes]
    margin = planner.DEFAULT_MARGIN if args.margin is None else args.margin
    problem = planner.Problem(profile, nodes, computes, args.wire_dtype, margin)
    plan = planner.plan(problem)
    recipe = Recipe(
        name=args.name or model.stem.replace(" ", "_")[:64],
        model_fingerprint=manifest.model_fingerprint,
        manifest_sha256=manifest.digest(),
        quantization=main_quantization(manifest),
        wire_dtype=args.wire_dtype,
        stages=[
            StagePlacement(
                node=nodes.nodes[s.node].name, layers=LayerRange(first=s.first, last=s.last)
            )
            for s in plan.stages
        ],
    )
    recipe.check(manifest)
    return {
        "model": model,
        "model_arg": args.model,
        "recipe_out": args.recipe_out,
        "nodes": nodes,
        "computes": computes,
        "plan": plan,
        "problem": problem,
        "recipe": recipe,
        "margin": margin,
        "options": options,
    }


def worker_command(result: dict[str, Any], stage: Any) -> str:
    """With a recipe written, the worker takes its range from it (and checks it first)."""
    node = result["nodes"].nodes[stage.node]
    o = result["options"]
    recipe = result.get("recipe_out")
    where = (
        f"--recipe {recipe} --node {node.name}"
        if recipe
        else f"--layers {stage.first}:{stage.last}"
    )
    return (
        f"dgr worker --model {result['model_arg']} {where} --listen {node.listen} "
        f"--threads {node.threads} --n-ctx {o.n_ctx} --max-sessions {o.max_sessions}"
    )


def route_string(result: dict[str, Any]) -> str:
    nodes = result["nodes"].nodes
    return ",".join(nodes[s.node].listen for s in result["plan"].stages)


def plan_json(result: dict[str, Any]) -> dict[str, Any]:
    plan, nodes = result["plan"], result["nodes"].nodes
    return {
        "predicted_ms_per_token": round(plan.latency_ms, 4),
        "predicted_tok_s": round(plan.tok_s, 3),
        "aggregate_tok_s": round(plan.throughput_tok_s, 3),
        "exact": plan.exact,
        "lower_bound_ms": round(plan.lower_bound_ms, 4),
        "gap": round(plan.gap, 4),
        "margin": result["margin"],
        "stages": [
            {
                "node": nodes[s.node].name,
                "layers": [s.first, s.last],
                "memory_bytes": s.memory_bytes,
                "node_memory_bytes": nodes[s.node].memory_bytes,
                "compute_ms": round(s.compute_ms, 4),
                "hop_ms": round(s.hop_ms, 4),
                "command": worker_command(result, s),
            }
            for s in plan.stages
        ],
        "route": route_string(result),
        "recipe": result["recipe"].model_dump(mode="json"),
        "recipe_id": result["recipe"].id,
        "computes": {
            n.name: c.model_dump() for n, c in zip(nodes, result["computes"], strict=True)
        },
    }


def render(result: dict[str, Any], args: argparse.Namespace) -> str:
    plan, nodes = result["plan"], result["nodes"].nodes
    how = (
        "exact: every node order and subset searched"
        if plan.exact
        else f"heuristic: {plan.gap:.1%} above a lower bound of {plan.lower_bound_ms:.2f} ms"
    )
    lines = [
        f"plan for {result['model'].name} over {len(nodes)} nodes ({how}); memory with a "
        f"{result['margin']:.0%} margin",
        f"{'node':<12}{'layers':<10}{'memory MiB':>12}{'free MiB':>10}{'compute ms':>12}"
        f"{'next hop ms':>13}",
    ]
    for s in plan.stages:
        node = nodes[s.node]
        lines.append(
            f"{node.name:<12}{f'{s.first}:{s.last}':<10}{s.memory_bytes / MIB:>12.1f}"
            f"{(node.memory_bytes - s.memory_bytes) / MIB:>10.1f}{s.compute_ms:>12.2f}"
            f"{s.hop_ms:>13.2f}"
        )
    unused = [n.name for i, n in enumerate(nodes) if i not in {s.node for s in plan.stages}]
    if unused:
        lines.append(f"unused: {', '.join(unused)} (a faster plan leaves them out)")
    lines += [
        f"predicted {plan.tok_s:.1f} tok/s ({plan.latency_ms:.2f} ms per decode token), "
        f"aggregate {plan.throughput_tok_s:.1f} tok/s over concurrent sessions",
        "",
        "start the workers:",
        *(f"  [{nodes[s.node].name}] {worker_command(result, s)}" for s in plan.stages),
        "",
        f"route: --route {route_string(result)}",
        f"recipe: {result['recipe'].id}"
        + (f" (written to {args.recipe_out})" if args.recipe_out else ""),
    ]
    return "\n".join(lines)
