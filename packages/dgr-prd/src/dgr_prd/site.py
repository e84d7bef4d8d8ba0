"""Evidence-site pages generated from prd.json and evidence/ into docs/generated/.

mkdocs then builds the site with --strict; nothing here is committed (docs/generated is ignored).
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from dgr_prd.evidence import EvidenceRecord, Result, all_records, story_dir
from dgr_prd.handoff import flatten_metrics, hardware_line
from dgr_prd.lanes import NOT_BUILT
from dgr_prd.model import Lane, Prd, Status, Story
from dgr_prd.paths import RepoPaths
from dgr_prd.projections import story_body

STATUS_COLOURS = {
    Status.DONE: "#2e7d32",
    Status.IN_PROGRESS: "#f9a825",
    Status.BLOCKED: "#c62828",
    Status.TODO: "#9e9e9e",
}
RESULT_BADGE = {Result.PASS: "PASS", Result.FAIL: "FAIL", Result.SKIPPED: "SKIPPED"}
LOG_EXCERPT_LINES = 30


def _ran_lanes(record: EvidenceRecord) -> str:
    lanes = sorted({c.lane.value for c in record.commands if c.exit_code is not None})
    return ", ".join(lanes) or "-"


def _status_plot(prd: Prd, out: Path) -> None:
    milestones = [m.id for m in prd.milestones]
    fig, ax = plt.subplots(figsize=(8, 3))
    bottom = [0] * len(milestones)
    for status in Status:
        counts = [
            sum(1 for s in prd.stories if s.milestone == m and s.status is status)
            for m in milestones
        ]
        ax.bar(milestones, counts, bottom=bottom, label=status.value, color=STATUS_COLOURS[status])
        bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    ax.set_ylabel("stories")
    ax.set_ylim(0, max(bottom) * 1.35 + 1)  # headroom for the legend
    ax.set_title("Story status by milestone")
    ax.legend(ncol=4, fontsize="small")
    fig.tight_layout()
    fig.savefig(out, format="svg")
    plt.close(fig)


def _numeric_metrics(record: EvidenceRecord) -> list[tuple[str, float]]:
    return [
        (k, float(v))
        for k, v in flatten_metrics(record.metrics)
        if isinstance(v, int | float) and not isinstance(v, bool)
    ]


PLOT_MAX_BARS = 40


def _metrics_plot(record: EvidenceRecord, out: Path) -> bool:
    # per-layout detail belongs in the table; a plot of hundreds of bars says nothing
    values = [(k, v) for k, v in _numeric_metrics(record) if ".per_layout." not in f".{k}."]
    values = values[:PLOT_MAX_BARS]
    if not values:
        return False
    label = max(len(k) for k, _ in values)
    fig, ax = plt.subplots(figsize=(6 + 0.08 * label, 0.4 * len(values) + 1.2))
    ax.barh([k for k, _ in values], [v for _, v in values], color="#1565c0")
    ax.invert_yaxis()
    ax.set_title(f"Metrics of run {record.run_id}")
    fig.tight_layout()
    fig.savefig(out, format="svg")
    plt.close(fig)
    return True


def _duration_plot(records: list[EvidenceRecord], out: Path) -> bool:
    """Seconds per evidence command across runs: compare runs of the same story at a glance."""
    names = sorted({c.name for r in records for c in r.commands if c.exit_code is not None})
    if not names:
        return False
    fig, ax = plt.subplots(figsize=(8, 3))
    labels = [r.run_id[:15] for r in records]
    for name in names:
        ys = [
            next((c.duration_s for c in r.commands if c.name == name), float("nan"))
            for r in records
        ]
        ax.plot(labels, ys, marker="o", label=name)
    ax.set_ylabel("seconds")
    ax.set_title("Evidence command duration per run")
    ax.tick_params(axis="x", labelrotation=30, labelsize="small")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, format="svg")
    plt.close(fig)
    return True


def _log_excerpt(run_dir: Path, log_name: str | None) -> list[str]:
    if not log_name or not (run_dir / log_name).is_file():
        return []
    lines = (run_dir / log_name).read_text(encoding="utf-8", errors="replace").splitlines()
    excerpt = lines[-LOG_EXCERPT_LINES:]
    return ["```text", *[line.replace("```", "'''") for line in excerpt], "```"]


def render_story_page(paths: RepoPaths, prd: Prd, story: Story, plots: Path) -> str:
    records = all_records(paths.evidence, story.id)
    lines = [*story_body(story, "#")]
    if not records:
        lines += [
            "## Evidence",
            "",
            f"No evidence has been recorded for this story yet. Run `nox -s story-{story.id}`.",
            "",
        ]
        return "\n".join(lines)
    latest = records[-1]
    run_dir = story_dir(paths.evidence, story.id) / latest.run_id
    lines += [
        "## Latest evidence",
        "",
        f"**Result: {RESULT_BADGE[latest.result]}** ({latest.reason})",
        "",
        "| field | value |",
        "|---|---|",
        f"| run | `{latest.run_id}` |",
        f"| started / finished (UTC) | {latest.started_utc} / {latest.finished_utc} |",
        f"| commit | `{latest.git.commit or 'none'}`{' (dirty)' if latest.git.dirty else ''} |",
        f"| hardware | {hardware_line(latest.hardware)} |",
        f"| CPU flags of note | {', '.join(latest.hardware['cpu']['notable_flags']) or '-'} |",
        f"| lanes available | {', '.join(lane.value for lane in latest.lanes_available)} |",
        f"| llama.cpp pin | {(latest.llama_cpp_pin or {}).get('commit', 'not pinned yet')} |",
        f"| patch stack sha256 | {latest.patch_stack_sha256 or 'no patches yet'} |",
        "",
        "### Commands",
        "",
        "| command | lane | result | exit | seconds | reason |",
        "|---|---|---|---|---|---|",
    ]
    for c in latest.commands:
        exit_text = "-" if c.exit_code is None else str(c.exit_code)
        lines.append(
            f"| `{c.name}` | {c.lane.value} | {c.result.value} | {exit_text} | "
            f"{c.duration_s:.1f} | {c.reason or '-'} |"
        )
    metric_rows = flatten_metrics(latest.metrics)
    if metric_rows:
        lines += ["", "### Metrics", "", "| metric | value |", "|---|---|"]
        lines += [f"| `{k}` | {v} |" for k, v in metric_rows]
    if _metrics_plot(latest, plots / f"{story.id}-metrics.svg"):
        lines += ["", f"![Metrics of the latest run](../plots/{story.id}-metrics.svg)"]
    if _duration_plot(records, plots / f"{story.id}-durations.svg"):
        lines += ["", f"![Durations per run](../plots/{story.id}-durations.svg)"]
    lines += ["", "### Log excerpts", ""]
    for c in latest.commands:
        excerpt = _log_excerpt(run_dir, c.log)
        if excerpt:
            lines += [f"`{c.name}` (last {LOG_EXCERPT_LINES} lines):", "", *excerpt, ""]
    lines += ["### Handoff", ""]
    handoff = run_dir / "handoff.md"
    if handoff.is_file():
        body = handoff.read_text(encoding="utf-8").splitlines()[1:]  # drop its H1
        lines += [
            line.replace("## ", "#### ", 1) if line.startswith("## ") else line for line in body
        ]
    lines += [
        "",
        "### Run history",
        "",
        "| run | result | lanes run | reason |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| `{r.run_id}` | {r.result.value} | {_ran_lanes(r)} | {r.reason} |"
        for r in reversed(records)
    ]
    return "\n".join(lines) + "\n"


def render_dashboard(paths: RepoPaths, prd: Prd) -> str:
    counts = Counter(s.status for s in prd.stories)
    lines = [
        "# Dashboard",
        "",
        f"{len(prd.stories)} stories: "
        + ", ".join(f"{counts[s]} {s.value}" for s in Status)
        + ". Status is written only by the story runner after evidence ran.",
        "",
        "![Story status by milestone](plots/status.svg)",
        "",
        "| story | title | milestone | gate | status | last result | last run (UTC) | lane |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in prd.stories:
        records = all_records(paths.evidence, s.id)
        last = records[-1] if records else None
        result = RESULT_BADGE[last.result] if last else "-"
        when = last.finished_utc if last else "-"
        lane = _ran_lanes(last) if last else "-"
        lines.append(
            f"| [{s.id}](stories/{s.id}.md) | {s.title} | {s.milestone} | "
            f"{s.gate.value} | {s.status.value} | {result} | {when} | {lane} |"
        )
    return "\n".join(lines) + "\n"


def _route_bench_plot(by_threads: dict[str, Any], out: Path) -> None:
    setups = list(next(iter(by_threads.values()))["rows"])
    fig, ax = plt.subplots(figsize=(max(8.0, 0.75 * len(setups)), 3.6))
    width = 0.8 / max(len(by_threads), 1)
    for i, (threads, result) in enumerate(sorted(by_threads.items())):
        xs = [n + i * width for n in range(len(setups))]
        ax.bar(
            xs,
            [result["rows"][name]["decode"] for name in setups],
            width,
            label=f"{threads} thread(s) per process",
        )
    ax.set_xticks([n + width * (len(by_threads) - 1) / 2 for n in range(len(setups))])
    ax.set_xticklabels(setups, rotation=20, fontsize="small", ha="right")
    _finish(fig, ax, "decode tokens/s", "Route decode speed next to its references (same run)", out)


def _finish(fig: Any, ax: Any, ylabel: str, title: str, out: Path) -> None:
    """Label, legend and write a plot as SVG."""
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, format="svg")
    plt.close(fig)


def render_benchmarks(paths: RepoPaths, plots: Path) -> str:
    """evidence/bench/*.json as tables (and a plot for the route bench)."""
    lines = [
        "# Benchmarks",
        "",
        "The latest run of each bench session (`nox -s bench`, "
        "`bench-memory`, `bench-verify`); every ratio compares against a reference "
        "measured in the same run. Raw JSON: `evidence/bench/`.",
        "",
    ]
    bench_dir = paths.evidence / "bench"
    for path in sorted(bench_dir.glob("*.json")) if bench_dir.is_dir() else []:
        data = json.loads(path.read_text(encoding="utf-8"))
        lines += [f"## {path.stem}", ""]
        by_threads = data.get("by_threads", {})
        if by_threads and all("rows" in r for r in by_threads.values()):  # the route bench
            _route_bench_plot(data["by_threads"], plots / "bench-route.svg")
            lines += ["![Route decode speed](plots/bench-route.svg)", ""]
            for threads, result in sorted(data["by_threads"].items()):
                lines += [
                    f"### {threads} thread(s) per process",
                    "",
                    "| setup | prefill tok/s | decode tok/s |",
                    "|---|---|---|",
                ]
                lines += [
                    f"| {name} | {r['prefill']:.1f} | {r['decode']:.1f} |"
                    for name, r in result["rows"].items()
                ]
                lines += ["", "| ratio | value |", "|---|---|"]
                lines += [f"| `{k}` | {v:.3f} |" for k, v in result["ratios"].items()]
                lines.append("")
                if "paired" in result:  # the gate's values: interleaved rounds
                    per_round = result["paired"]["per_round"]
                    lines += [
                        f"Interleaved rounds ({len(next(iter(per_round.values())))}: every "
                        "reference and route once per round, back to back); the gate reads "
                        "the medians.",
                        "",
                        "| ratio | median | min | max |",
                        "|---|---|---|---|",
                    ]
                    lines += [
                        f"| `{k}` | {result['paired']['ratios'][k]:.3f} | {min(v):.3f} | "
                        f"{max(v):.3f} |"
                        for k, v in per_round.items()
                    ]
                    lines.append("")
        else:
            rows = [(k, v) for k, v in flatten_metrics(data) if not isinstance(v, list)]
            lines += ["| field | value |", "|---|---|"] + [f"| `{k}` | {v} |" for k, v in rows]
            lines += _plan_tables(data.get("scenarios", []))
            for stage in data.get("stages", []):
                if stage is data["stages"][0]:
                    lines += [
                        "",
                        "| stage | layers | weights MiB | KV MiB | compute MiB | RSS MiB | ratio |",
                        "|---|---|---|---|---|---|---|",
                    ]
                lines.append(
                    f"| {stage['stage']} | {stage['layers']} | "
                    f"{stage['owned_weight_bytes'] / 2**20:.1f} | {stage['kv_bytes'] / 2**20:.1f}"
                    f" | {stage['compute_bytes'] / 2**20:.1f} | {stage['rss_bytes'] / 2**20:.1f}"
                    f" | {stage['rss_over_estimate']:.3f} |"
                )
            lines.append("")
    return "\n".join(lines) + "\n"


def _plan_tables(scenarios: list[dict[str, Any]]) -> list[str]:
    """bench-plan: each generated scenario's nodes, the plan, and prediction against measurement."""
    lines: list[str] = []
    for sc in scenarios:
        nodes = ", ".join(
            f"{n['name']} ({n['threads']} thr, {n['memory_mib']:g} MiB, link {n['link_ms']} ms)"
            for n in sc["nodes"]
        )
        even = (
            f"even split measured {sc['even_measured_tps']:.1f} tok/s"
            if sc["even_split_fits"]
            else "even split does not fit"
        )
        lines += [
            "",
            f"### Scenario seed {sc['seed']}",
            "",
            f"Nodes: {nodes}.",
            "",
            "| node | layers | estimate MiB | RSS MiB | compute ms | next hop ms | forwards "
            "| mean forward ms |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {p['node']} | {p['layers'][0]}:{p['layers'][1]} | {p['estimate_mib']} | "
            f"{p['rss_mib']} | {p['compute_ms']} | {p['hop_ms']} | "
            f"{p.get('metrics', {}).get('forwards', '-')} | "
            f"{p.get('metrics', {}).get('mean_forward_ms', '-')} |"
            for p in sc["plan"]
        ]
        lines += [
            "",
            f"Predicted {sc['predicted_tps']:.1f} tok/s, measured {sc['measured_tps']:.1f} "
            f"({sc['relative_error']:.1%} off); {even}.",
        ]
    return lines


def _soak_plot(samples: list[dict[str, Any]], warmup_s: float, out: Path) -> None:
    names = [k for k in samples[0] if isinstance(samples[0][k], dict)]
    fig, ax = plt.subplots(figsize=(8.0, 3.4))
    for name in names:
        ax.plot([s["t"] for s in samples], [s[name]["rss_kib"] / 1024 for s in samples], label=name)
    ax.axvline(warmup_s, color="grey", linestyle=":", label="end of warm-up")
    ax.set_xlabel("seconds")
    _finish(
        fig, ax, "RSS MiB", "Soak: resident memory of each worker and of the OpenAI server", out
    )


# what the evidence cannot say about a lane that never ran here
LANE_NOTES = {
    "cpu": "built by every test run (DGR-034)",
    "vulkan": "built with `dgr-native build --lane vulkan` (lane-deps.json); mixed routes with "
    "CPU stages allowed",
    **{lane.value: why for lane, why in NOT_BUILT.items()},
}


def render_lanes(paths: RepoPaths) -> list[str]:
    """One row per lane: how it is built, the device its probe ran on and its verdict
    (evidence/bench/lane-<lane>.json), and its passing certification records."""
    lines = [
        "## Lanes",
        "",
        "A worker advertises a lane only with a passing record for its exact descriptor and "
        "hardware. A probe (`nox -s lane-probe -- --lane LANE`) compares a lane's routes with the "
        "CPU lane before any certification.",
        "",
        "| lane | build | device (probe) | probe: NMSE max, greedy | certified records |",
        "|---|---|---|---|---|",
    ]
    for lane in Lane:
        probe = paths.evidence / "bench" / f"lane-{lane.value}.json"
        device, verdict = ("host CPU", "reference") if lane == Lane.CPU else ("-", "-")
        if probe.exists():
            p = json.loads(probe.read_text(encoding="utf-8"))
            device = p["device"]
            rows = p["rows"]
            worst = max(r["nmse_max"] for r in rows)
            greedy = "identical" if all(r["greedy_identical"] for r in rows) else "diverges"
            met = "meets" if all(r["meets_bar"] for r in rows) else "misses"
            verdict = f"{worst:.1e}, {greedy} ({met} the bar, {p['measured_utc']})"
        passing = [
            r
            for r in (
                json.loads(f.read_text(encoding="utf-8"))
                for f in sorted((paths.root / "certification" / lane.value).glob("*.json"))
            )
            if r.get("passed")
        ]
        certified = ", ".join(r["model"] for r in passing) or "none"
        lines.append(
            f"| {lane.value} | {LANE_NOTES[lane.value]} | {device} | {verdict} | {certified} |"
        )
    return [*lines, ""]


def render_lane_records(paths: RepoPaths) -> list[str]:
    """certification/<lane>/*.json: the sealed records a worker's advertised lanes come from."""
    records = sorted((paths.root / "certification").glob("*/*.json"))
    lines = [
        "## Certification records",
        "",
        "Sealed records of `nox -s certify -- --lane LANE` (`certification/`): a worker "
        "advertises a lane only where an intact, passing record matches its exact descriptor "
        "and hardware.",
        "",
        "| lane | device | model | layouts | largest logit difference | passed | commit | "
        "hardware | record |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for path in records:
        r = json.loads(path.read_text(encoding="utf-8"))
        lines.append(
            f"| {r['lane']} | {r.get('device') or 'cpu'} | {r['model']} | {r['layouts']} | "
            f"{r['max_abs_logit_diff']} | "
            f"{r['passed']} | `{r['commit'][:10]}` | `{r['hardware_sha256'][:12]}` | "
            f"`{r['record_sha256'][:12]}` |"
        )
    if not records:
        lines.append("| (none) | | | | | | | | |")
    return [*lines, ""]


def render_certification(paths: RepoPaths, plots: Path) -> str:
    """evidence/chaos, evidence/soak and evidence/fuzz: the latest run of each, summarized."""
    lines = [
        "# Faults, soak and fuzzing",
        "",
        "The latest run of `nox -s chaos` (seeded fault injection into real routes), "
        "`nox -s soak` (load over time) and `nox -s fuzz` (libFuzzer over the worker's "
        "decoders). Raw JSON: `evidence/chaos/`, `evidence/soak/`, `evidence/fuzz/`.",
        "",
        *render_lanes(paths),
        *render_lane_records(paths),
    ]
    chaos = paths.evidence / "chaos" / "chaos.json"
    if chaos.is_file():
        data = json.loads(chaos.read_text(encoding="utf-8"))
        lines += [f"## Chaos ({data['measured_utc']})", "", "| figure | value |", "|---|---|"]
        lines += [f"| `{k}` | {v} |" for k, v in data["summary"].items()]
        lines.append("")
    soak = paths.evidence / "soak" / "soak.json"
    if soak.is_file():
        data = json.loads(soak.read_text(encoding="utf-8"))
        lines += [f"## Soak ({data['measured_utc']})", ""]
        if data.get("samples"):
            _soak_plot(data["samples"], data["warmup_s"], plots / "soak-rss.svg")
            lines += ["![RSS over time](plots/soak-rss.svg)", ""]
        lines += ["| figure | value |", "|---|---|"]
        lines += [
            f"| `{k}` | {v} |"
            for k, v in data.items()
            if k not in ("samples", "processes", "error_examples")
        ]
        lines += [
            "",
            "| process | RSS MiB after warm-up | at the end | growth | fds | threads |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {name} | {p['rss_mib_start']} | {p['rss_mib_end']} | {p['rss_growth']:.2%} | "
            f"{p['fds_peak_first_quarter']} -> {p['fds_peak_last_quarter']} | "
            f"{p['threads_peak_first_quarter']} -> {p['threads_peak_last_quarter']} |"
            for name, p in data.get("processes", {}).items()
        ]
        lines.append("")
    fuzz = paths.evidence / "fuzz" / "fuzz.json"
    if fuzz.is_file():
        data = json.loads(fuzz.read_text(encoding="utf-8"))
        lines += [
            f"## Fuzzing ({data['measured_utc']})",
            "",
            "| harness | executions | seconds | exec/s | crashes | regression inputs |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['harness']} | {r['executions']} | {r['seconds']} | {r['exec_per_s']} | "
            f"{r['crashes']} | {r['regression_inputs']} |"
            for r in data["runs"]
        ]
        lines.append("")
    return "\n".join(lines) + "\n"


def render_gates(paths: RepoPaths, prd: Prd) -> str:
    """Each gate's review (what `dgr-prd gate-review ID` prints): its thresholds against the
    newest evidence with host, commit and verdict, and its stories; the home page includes this
    file."""
    from dgr_prd import review

    lines: list[str] = []
    for g in prd.gates:
        r = review.review(paths, prd, g.id.value)
        lines += [
            f"### Gate: {g.id.value}",
            "",
            f"{g.description} (`dgr-prd gate-review {g.id.value}`)",
            "",
            *review.render(r),
            "",
        ]
    return "\n".join(lines)


def generate(paths: RepoPaths, prd: Prd) -> list[Path]:
    out = paths.generated_docs
    if out.exists():
        shutil.rmtree(out)
    plots = out / "plots"
    (out / "stories").mkdir(parents=True)
    plots.mkdir()
    pages: dict[Path, str] = {
        out / "dashboard.md": render_dashboard(paths, prd),
        out / "prd.md": paths.prd_md.read_text(encoding="utf-8"),
        out / "benchmarks.md": render_benchmarks(paths, plots),
        out / "certification.md": render_certification(paths, plots),
        out / "gates.md": render_gates(paths, prd),
        out / "stories" / "index.md": "# Stories\n\n"
        + "\n".join(f"- [{s.id}: {s.title}]({s.id}.md) ({s.status.value})" for s in prd.stories)
        + "\n",
    }
    for story in prd.stories:
        pages[out / "stories" / f"{story.id}.md"] = render_story_page(paths, prd, story, plots)
    _status_plot(prd, plots / "status.svg")
    for path, text in pages.items():
        path.write_text(text, encoding="utf-8")
    return list(pages)
