"""`dgr-prd`: validate the backlog, regenerate projections and schemas, run stories."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from dgr_records import report

from dgr_prd import legacy, runner
from dgr_prd.evidence import latest_record
from dgr_prd.hardware import fingerprint
from dgr_prd.lanes import available_lanes
from dgr_prd.model import Prd, Status
from dgr_prd.paths import RepoPaths, find_root
from dgr_prd.projections import stale_projections, write_projections
from dgr_prd.schemas import stale_schemas, write_schemas
from dgr_prd.validate import PrdInvalid, validate_file


def _load(paths: RepoPaths) -> Prd:
    return validate_file(paths.prd, paths.schemas / "prd.schema.json", paths.evidence)


def cmd_validate(paths: RepoPaths, args: argparse.Namespace) -> int:
    prd = _load(paths)
    done = sum(s.status is Status.DONE for s in prd.stories)
    print(f"prd.json valid: {len(prd.stories)} stories, {done} done")
    report("validate", {"stories": len(prd.stories), "done": done})
    return 0


def cmd_project(paths: RepoPaths, args: argparse.Namespace) -> int:
    if args.check:
        stale = stale_schemas(paths.schemas)
        prd = _load(paths)
        stale += stale_projections(paths, prd)
        if stale:
            print("stale generated files (run `nox -s prd`):\n  " + "\n  ".join(stale))
            return 1
        print("schemas and projections are current")
        return 0
    written = write_schemas(paths.schemas)
    prd = _load(paths)
    changed = write_projections(paths, prd)
    print(f"wrote {len(written)} schemas; {len(changed)} projection files changed")
    return 0


def cmd_run_story(paths: RepoPaths, args: argparse.Namespace) -> int:
    try:
        outcome = runner.run_story(paths, args.story, override_deps=args.override_deps)
    except runner.DependenciesNotDone as exc:
        print(f"REFUSED: {exc}", file=sys.stderr)
        return runner.EXIT_REFUSED
    except KeyError as exc:
        print(f"REFUSED: {exc.args[0]}", file=sys.stderr)
        return runner.EXIT_REFUSED
    return outcome.exit_code


def cmd_status(paths: RepoPaths, args: argparse.Namespace) -> int:
    prd = _load(paths)
    for s in prd.stories:
        record = latest_record(paths.evidence, s.id)
        last = f"{record.result.value} {record.finished_utc}" if record else "-"
        print(f"{s.id}  {s.status.value:<11} {s.gate.value:<5} {last:<28} {s.title}")
    ready = [
        s
        for s in prd.stories
        if s.status is not Status.DONE
        and all(prd.story(d).status is Status.DONE for d in s.depends_on)
    ]
    print("\nready to work on (dependencies done): " + ", ".join(s.id for s in ready[:12]))
    return 0


def cmd_fingerprint(paths: RepoPaths, args: argparse.Namespace) -> int:
    hw = fingerprint()
    print(json.dumps({"hardware": hw, "lanes": available_lanes(hw)}, indent=2))
    return 0


def cmd_check_legacy(paths: RepoPaths, args: argparse.Namespace) -> int:
    problems = legacy.problems(paths)
    for p in problems:
        print(f"legacy: {p}")
    report("legacy", {"problems": len(problems)})
    if not problems:
        print("no legacy story specs; prd.json is the only backlog and its projections match")
    return 1 if problems else 0


def cmd_site(paths: RepoPaths, args: argparse.Namespace) -> int:
    from dgr_prd import site  # matplotlib is slow to import; only the site needs it

    pages = site.generate(paths, _load(paths))
    print(f"generated {len(pages)} evidence-site pages under {paths.generated_docs}")
    return 0


def cmd_perf(paths: RepoPaths, args: argparse.Namespace) -> int:
    """The bench log: with --backfill, its runs from the git history of evidence/bench/ merged
    in (each run once); then docs/perf.md regenerated from it."""
    import json

    from dgr_records import HISTORY

    from dgr_prd.perf import backfill, read_history, render_perf

    log = paths.evidence / "bench" / HISTORY
    if args.backfill:
        runs = {(r["bench"], r["measured_utc"]): r for r in backfill(paths)}
        runs |= {(r["bench"], r["measured_utc"]): r for r in read_history(log)}
        ordered = sorted(runs.values(), key=lambda r: (r["measured_utc"], r["bench"]))
        log.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in ordered))
        print(f"{log.relative_to(paths.root)}: {len(ordered)} runs")
    out = paths.docs / "perf.md"
    out.write_text(render_perf(paths), encoding="utf-8")
    print(f"wrote {out.relative_to(paths.root)}")
    return 0


def cmd_gate(paths: RepoPaths, args: argparse.Namespace) -> int:
    from dgr_records import report

    from dgr_prd import gate

    rows = gate.evaluate(paths, _load(paths), args.gate)
    print(f"gate {args.gate}:")
    print("\n".join(gate.table(rows)))
    missed = [r for r in rows if not r.passed]
    report(
        "gate",
        {
            "gate": args.gate,
            "thresholds": len(rows),
            "passed": len(rows) - len(missed),
            "missed": [r.metric for r in missed if r.unmeasurable is None],
            "not_measurable_here": [r.metric for r in missed if r.unmeasurable is not None],
        },
    )
    for r in missed:
        print(f"{r.metric}: {r.verdict} (threshold {r.op} {r.threshold:g})", file=sys.stderr)
    return 1 if missed else 0


def cmd_gate_review(paths: RepoPaths, args: argparse.Namespace) -> int:
    from dgr_records import report

    from dgr_prd import review

    r = review.review(paths, _load(paths), args.gate)
    print("\n".join(review.render(r)))
    report(
        "gate_review",
        {
            "gate": args.gate,
            "passed": r.passed,
            "thresholds_passed": sum(t.passed for t in r.thresholds),
            "thresholds": len(r.thresholds),
            "not_measurable_here": sum(t.unmeasurable is not None for t in r.thresholds),
            "stories_passed": sum(s.passed for s in r.stories),
            "stories": len(r.stories),
            "clean_tree": r.clean_tree,
        },
    )
    return 0 if r.passed else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dgr-prd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    commands: dict[str, tuple[Callable[[RepoPaths, argparse.Namespace], int], str]] = {
        "validate": (cmd_validate, "validate prd.json (JSON Schema and backlog rules)"),
        "project": (cmd_project, "regenerate schemas/, PRD.md, stories/, RALPH status"),
        "run-story": (cmd_run_story, "run a story's evidence and record it"),
        "status": (cmd_status, "print every story's status and last evidence"),
        "fingerprint": (cmd_fingerprint, "print this machine's hardware fingerprint and lanes"),
        "check-legacy": (cmd_check_legacy, "DGR-017: no legacy specs, prd.json the authority"),
        "perf": (cmd_perf, "regenerate docs/perf.md from the bench log (--backfill: from git)"),
        "site": (cmd_site, "generate the evidence-site pages into docs/generated/"),
        "gate": (cmd_gate, "check a gate's thresholds (prd.json) against the newest evidence"),
        "gate-review": (
            cmd_gate_review,
            "a gate's review from committed evidence: thresholds with host, commit and verdict, "
            "and every story of the gate",
        ),
    }
    for name, (func, help_text) in commands.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(func=func)
        if name in ("gate", "gate-review"):
            p.add_argument("gate", help="gate id, e.g. alpha")
        if name == "perf":
            p.add_argument("--backfill", action="store_true", help="add the runs git holds")
        if name == "project":
            p.add_argument("--check", action="store_true", help="fail when anything is stale")
        if name == "run-story":
            p.add_argument("story", help="story id, e.g. DGR-019")
            p.add_argument(
                "--override-deps",
                action="store_true",
                help="run although dependencies are not done (recorded)",
            )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        paths = find_root()
        code: int = args.func(paths, args)
    except PrdInvalid as exc:
        print(str(exc), file=sys.stderr)
        return runner.EXIT_INVALID_PRD
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return runner.EXIT_INVALID_PRD
    return code


if __name__ == "__main__":
    sys.exit(main())
