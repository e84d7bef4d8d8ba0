"""`nox -s certify -- --lane cpu|vulkan` (DGR-060, issue 16): certify this machine's lane for each
model. On the CPU lane the layout parity harness runs every generated layout in process and over
real workers (both modes); a model passes when every f32 layout is bitwise equal to one process
and greedy-identical. On another lane the lane probe's layouts (all stages on the lane, and mixed
with CPU stages) run against the CPU lane's whole model in one process; a model passes when every
layout keeps the logits' NMSE within 1e-4 and the greedy tokens equal. Each result becomes a
sealed certification record (dgr_meshnet.certification) bound to the exact descriptor a worker of
that build reports, to this machine's hardware fingerprint and, off the CPU, to the device as its
driver names it, written to certification/<lane>/. Records are written only from a clean tree, at
the commit they name.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from dgr_cli.workers import start_worker
from dgr_meshnet.certification import CertificationRecord, hardware_sha256, seal, write_record
from dgr_meshnet.collect import descriptor
from dgr_prd.hardware import fingerprint
from dgr_prd.lanes import available_lanes
from dgr_prd.paths import find_root
from dgr_prd.runner import git_state
from dgr_records import report

from dgr_cert.layout_parity import DEFAULT_MODELS
from dgr_cert.layout_parity import certify as layout_parity


def certify_model(
    lane: str,
    name: str,
    model: Path,
    commit: str,
    stages: list[int],
    prompt_tokens: int = 200,
    decode: int = 16,
) -> CertificationRecord:
    result = layout_parity(name, model, stages, prompt_tokens, decode, seed=0, workers=True)
    m = result["metrics"]
    worker_diffs = [
        v
        for layout in m["per_layout"].values()
        for k, v in layout.items()
        if k.startswith("workers_") and k.endswith("_max_abs_logit_diff")
    ]
    return sealed(
        lane,
        name,
        model,
        int(m["n_layer"]),
        commit,
        layouts=int(m["layouts"]),
        max_abs_logit_diff=float(max([m["in_process_f32_max_abs_logit_diff"], *worker_diffs])),
        passed=bool(m["in_process_f32_all_bitwise"] and m["workers_all_bitwise"] is True),
    )


def sealed(
    lane: str, name: str, model: Path, n_layer: int, commit: str, **figures: object
) -> CertificationRecord:
    """The record of a certification run's `figures`, bound to the descriptor a worker of this
    build reports for the whole model on `lane` and to this machine's hardware."""
    extra = [] if lane == "cpu" else ["--gpu-layers", "-1"]
    worker = start_worker(model, 0, n_layer, n_ctx=64, max_sessions=1, lane=lane, extra=extra)
    try:
        described = descriptor(worker.address)
    finally:
        worker.stop()
    if described.lane != lane:
        raise SystemExit(f"the {lane} lane was asked for, but the worker build is {described.lane}")
    return seal(
        descriptor=described,
        hardware_sha256=hardware_sha256(fingerprint()),
        lane=lane,
        model=name,
        commit=commit,
        created_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **figures,
    )


def certify_lane_model(lane: str, name: str, model: Path, commit: str) -> CertificationRecord:
    """A non-CPU lane: the lane probe's layouts of `name` against the CPU lane in one process."""
    from dgr_native.parity import reference_run

    from dgr_cert import lane_probe

    if name not in lane_probe.LAYOUTS:
        raise SystemExit(f"no probe layouts for {name} (known: {', '.join(lane_probe.LAYOUTS)})")
    reference = reference_run(model, lane_probe.DECODE)
    rows = [lane_probe.probe(lane, name, layout, reference) for layout in lane_probe.LAYOUTS[name]]
    for r in rows:
        print(
            f"  {'+'.join(r['stage_lanes'])} {r['layout']}: NMSE max {r['nmse_max']:.2e}, greedy "
            f"{'identical' if r['greedy_identical'] else 'diverges'}: "
            f"{'met' if r['meets_bar'] else 'MISSED'}",
            flush=True,
        )
    return sealed(
        lane,
        name,
        model,
        max(b for layout in lane_probe.LAYOUTS[name] for _, b, _ in layout),
        commit,
        layouts=len(rows),
        max_abs_logit_diff=max(r["max_abs_logit_diff"] for r in rows),
        passed=all(r["meets_bar"] for r in rows),
        device=lane_probe.device_name(lane),
    )


def main(argv: list[str] | None = None) -> int:
    from dgr_artifacts.models import model_path

    parser = argparse.ArgumentParser(prog="python -m dgr_cert.certify")
    parser.add_argument("--lane", required=True)
    parser.add_argument(
        "--model", action="append", help=f"default: {' '.join(DEFAULT_MODELS)} (cpu lane)"
    )
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument(
        "--out", type=Path, help="where the records go (default: certification/LANE in the tree)"
    )
    args = parser.parse_args(argv)
    if args.lane == "cuda":  # what the GPU machine lacks, named before anything runs
        from dgr_cert import lane_probe

        try:
            print(f"cuda preflight: {lane_probe.preflight_cuda()}")
        except lane_probe.PreflightError as e:
            print(f"cuda preflight failed: {e}")
            return 2
    lanes = [lane.value for lane in available_lanes(fingerprint())]
    if args.lane not in lanes:
        print(f"no {args.lane} lane on this machine (available: {', '.join(lanes)})")
        return 2
    paths = find_root()
    git = git_state(paths.root)
    if git.commit is None and (copied := os.environ.get("DGR_SOURCE_COMMIT")):
        # a copy of a committed tree without its .git (a lent device host): the commit it was
        # copied from, as the device script was given it
        git = git.model_copy(update={"commit": copied, "dirty": False})
    if git.dirty or not git.commit:
        print("certification records are written only from a clean tree: commit first")
        return 2
    out = args.out or paths.root / "certification" / args.lane
    records = []
    if args.lane == "vulkan":  # Mesa's lavapipe is skipped by ggml-vulkan unless named
        os.environ.setdefault("GGML_VK_VISIBLE_DEVICES", "0")
    for name in args.model or DEFAULT_MODELS:
        if args.lane == "cpu":
            record = certify_model(args.lane, name, model_path(name), git.commit, args.stages)
        else:
            record = certify_lane_model(args.lane, name, model_path(name), git.commit)
        path = write_record(out, record)
        records.append(record)
        print(
            f"{name} on {args.lane}{f' ({record.device})' if record.device else ''}: "
            f"{'PASS' if record.passed else 'FAIL'}, {record.layouts} "
            f"layouts, largest logit difference {record.max_abs_logit_diff:g}; "
            f"{path} (sealed {record.record_sha256[:12]})"
        )
    report(
        "certify",
        {
            "lane": args.lane,
            "records": len(records),
            "passed": sum(r.passed for r in records),
            "max_abs_logit_diff": max(r.max_abs_logit_diff for r in records),
        },
    )
    return 0 if all(r.passed for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
