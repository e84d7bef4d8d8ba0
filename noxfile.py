"""nox sessions for the DGR monorepo.

Every session runs in the one workspace environment that `uv sync` builds (python=False), so the
lock file is the single source of the toolchain. Run them as `uv run nox -s NAME` (or `./dev`).
Story sessions (`story-DGR-017` .. `story-DGR-071`) are generated from prd.json.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "none"

# Exit codes of `dgr-prd run-story` (dgr_prd.runner): 5 = skipped for a missing lane.
STORY_SKIPPED = 5
PYTEST_NO_TESTS = 5


@nox.session(python=False)
def prd(session: nox.Session) -> None:
    """Regenerate schemas/, PRD.md, stories/*.md and RALPH-CONTEXT.md's status from prd.json."""
    session.run("dgr-prd", "project")


@nox.session(python=False)
def validate(session: nox.Session) -> None:
    """Validate prd.json against its JSON Schema and the backlog rules."""
    session.run("dgr-prd", "validate")


@nox.session(python=False)
def lint(session: nox.Session) -> None:
    """ruff (lint and format) and mypy --strict over packages/."""
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", "--strict", *[str(p) for p in sorted(ROOT.glob("packages/*/src"))])


@nox.session(python=False)
def tests(session: nox.Session) -> None:
    """Every test (README's test command, CI's): first the tests that start no worker process,
    spread over every core (pytest-xdist: they share nothing a test times), then the `fleet`
    tests one at a time, as their deadlines and timed figures assume the cores are theirs.
    Arguments go to both runs; it fails when either fails or when neither collected a test."""
    codes = [
        subprocess.call(["pytest", "-m", marks, *workers, *session.posargs], cwd=ROOT)
        for marks, workers in (("not fleet", ["-n", "auto"]), ("fleet", []))
    ]
    if codes == [PYTEST_NO_TESTS, PYTEST_NO_TESTS]:
        session.error("pytest collected no tests: the selection or configuration is wrong")
    for name, code in zip(("starting no worker", "fleet"), codes, strict=True):
        if code not in (0, PYTEST_NO_TESTS):
            session.error(f"pytest of the tests {name} failed with exit code {code}")


@nox.session(python=False)
def check(session: nox.Session) -> None:
    """The fast tier (`./dev check`, after lint): the native build check and every test that
    starts no worker process (tests marked `fleet` are left out, and DGR_NO_WORKERS makes one
    that starts a worker anyway fail, naming the marker)."""
    session.run("dgr-native", "build")
    session.run(
        "pytest", "-m", "not fleet", "-n", "auto", "-q", *session.posargs,
        env={"DGR_NO_WORKERS": "1"},
    )  # fmt: skip


@nox.session(name="tests-slow", python=False)
def tests_slow(session: nox.Session) -> None:
    """The tests marked slow (batched parity at 4 threads per worker on 3 stages, ...)."""
    session.run("pytest", "-m", "slow", "--slow", *session.posargs)


@nox.session(python=False)
def docs(session: nox.Session) -> None:
    """Generate the evidence pages and build the mkdocs-material site with --strict."""
    session.run("dgr-prd", "site")
    session.run("mkdocs", "build", "--strict", "--site-dir", str(ROOT / "site"))


@nox.session(python=False)
def proto(session: nox.Session) -> None:
    """dgr.v1 wire: `-- check` (default: installed generated code current, lint, compatibility),
    `-- lock` (record the published schema after adding fields)."""
    session.run("dgr-proto", *(session.posargs or ["check"]))


@nox.session(name="native-fetch", python=False)
def native_fetch(session: nox.Session) -> None:
    """Fetch the pinned llama.cpp into the native workspace; verify archive and tree hashes."""
    session.run("dgr-llamacpp", "fetch")


@nox.session(name="native-patches", python=False)
def native_patches(session: nox.Session) -> None:
    """Patch stack: `-- check` (default), `-- apply`, `-- reverse`, `-- refresh`, `-- list`."""
    session.run("dgr-llamacpp", "patches", *(session.posargs or ["check"]))


@nox.session(name="native-build", python=False)
def native_build(session: nox.Session) -> None:
    """Build patched llama.cpp (cached, outside the tree) and the ShardEngine Python module;
    `-- --lane cuda|vulkan` for another lane (CUDA: its toolkit comes from PyPI's wheels, pinned
    in native/llama.cpp/lane-deps.json; ggml-cuda for sm_90 takes about 20 minutes on 2 cores)."""
    session.run("dgr-llamacpp", "build", *session.posargs)
    session.run("dgr-native", "build", *session.posargs)


@nox.session(name="test-native", python=False)
def test_native(session: nox.Session) -> None:
    """The worker's C++ unit tests under ctest (native/tests; `-- -R NAME` selects)."""
    session.run("python", "-m", "dgr_native.unittests", "--", *session.posargs)


@nox.session(name="test-native-asan", python=False)
def test_native_asan(session: nox.Session) -> None:
    """The same C++ unit tests, the worker and the tests built with ASan and UBSan."""
    session.run("python", "-m", "dgr_native.unittests", "--sanitize", "--", *session.posargs)


@nox.session(name="native-wheel", python=False)
def native_wheel(session: nox.Session) -> None:
    """Build the dgr-engine wheel (scikit-build-core), install it fresh, compare with dev build."""
    session.run("python", "-m", "dgr_native.wheel")


@nox.session(python=False)
def dist(session: nox.Session) -> None:
    """The distributable wheels into dist/ (dgr-engine and the runtime packages); `-- --check`
    then runs the README's install block on them in a fresh environment outside the checkout."""
    session.run("python", "-m", "dgr_native.dist", *session.posargs)


@nox.session(python=False)
def parity(session: nox.Session) -> None:
    """Chained in-process engines vs the whole model on the real models (2, 3, 5 stages);
    `-- --distributed ...`: the harness over generated layouts, in process and over workers."""
    args = list(session.posargs)
    if "--distributed" in args:
        args.remove("--distributed")
        session.run("python", "-m", "dgr_cert.layout_parity", *args)
    else:
        session.run("python", "-m", "dgr_native.parity", *args)


@nox.session(name="v4-twin", python=False)
def v4_twin(session: nox.Session) -> None:
    """Generate the DeepSeek V4 twins and check their bytes against the recorded manifests."""
    for name in session.posargs or ["dsv4-twin", "dsv4-twin-quick"]:
        session.run("dgr-native", "twin", name, "--check")


@nox.session(python=False)
def twins(session: nox.Session) -> None:
    """Generate every twin (V4, qwen2, qwen3, deepseek2) and check it against its manifest."""
    for name in session.posargs or [
        "dsv4-twin",
        "dsv4-twin-quick",
        "qwen2-twin",
        "qwen3-twin",
        "deepseek2-twin",
    ]:
        session.run("dgr-native", "twin", name, "--check")


def _bench(session: nox.Session, module: str, *args: str) -> None:
    """Run a bench module, then regenerate the projections: the bench appends its headline to
    evidence/bench/history.jsonl, and docs/perf.md (a projection of that log) must be committed
    with it or the projection tests fail."""
    session.run("python", "-m", module, *args)
    session.run("dgr-prd", "project")


@nox.session(name="bench-seam-bytes", python=False)
def bench_seam_bytes(session: nox.Session) -> None:
    """Bytes per token per seam on real 3-stage routes (SmolLM2, the V4 twin; real V4 stated)."""
    _bench(session, "dgr_bench.seam_bytes", *session.posargs)


@nox.session(name="bench-wan", python=False)
def bench_wan(session: nox.Session) -> None:
    """DGR and llama.cpp RPC decode through simulated WAN links (0, 1, 10 ms added)."""
    _bench(session, "dgr_bench.bench_wan", *session.posargs)


@nox.session(name="bench-seam", python=False)
def bench_seam(session: nox.Session) -> None:
    """The seam-cost model against measurements through simulated links (within 20%)."""
    _bench(session, "dgr_bench.bench_wan", "--seam-model", *session.posargs)


@nox.session(name="bench-spec", python=False)
def bench_spec(session: nox.Session) -> None:
    """Decode with and without prompt-lookup drafts on a 3-stage route, loopback and 10 ms links."""
    _bench(session, "dgr_bench.spec", *session.posargs)


@nox.session(name="bench-serve", python=False)
def bench_serve(session: nox.Session) -> None:
    """Many users over one route: chat TTFT with prefix reuse, sessions in flight, /health."""
    _bench(session, "dgr_bench.serve", *session.posargs)


@nox.session(name="bench-mtp", python=False)
def bench_mtp(session: nox.Session) -> None:
    """Decode with and without the tail's MTP drafts on a 3-stage V4 twin route (DGR-069)."""
    _bench(session, "dgr_bench.mtp", *session.posargs)


@nox.session(name="bench-plan", python=False)
def bench_plan(session: nox.Session) -> None:
    """Planned routes on loopback through generated links: measured vs predicted, vs even split."""
    _bench(session, "dgr_bench.plan", *session.posargs)


@nox.session(name="bench-memory", python=False)
def bench_memory(session: nox.Session) -> None:
    """Per-stage RSS of a 3-way split next to owned weights, KV and compute buffers."""
    _bench(session, "dgr_native.memory", *session.posargs)


@nox.session(python=False)
def bench(session: nox.Session) -> None:
    """Route speed vs single-process llama.cpp and llama.cpp RPC, same run (JSON to evidence/):
    the bench log's line and the regenerated docs/perf.md are committed with it."""
    _bench(session, "dgr_bench.bench", *session.posargs)


@nox.session(name="bench-verify", python=False)
def bench_verify(session: nox.Session) -> None:
    """Resumable verification throughput vs sha256sum, measured side by side (JSON to evidence/)."""
    _bench(session, "dgr_bench.verify")


@nox.session(python=False)
def chaos(session: nox.Session) -> None:
    """Seeded fault injection into real routes with concurrent sessions, 216 faults by default
    (`-- --seed S --faults N`, `--only I` replays one); JSON to evidence/chaos/."""
    session.run("python", "-m", "dgr_cert.chaos", *session.posargs)


@nox.session(python=False)
def soak(session: nox.Session) -> None:
    """Concurrent sessions on a 3-stage route and through the OpenAI server for 10 minutes
    (`-- --seconds N`): worker RSS, fds, threads and sessions over time; JSON and plot to
    evidence/soak/."""
    session.run("python", "-m", "dgr_cert.soak", *session.posargs)


@nox.session(name="conn-flood", python=False)
def conn_flood(session: nox.Session) -> None:
    """10,000 unauthenticated connections held against a worker while a route generates: the
    worker's threads and RSS stay bounded, the tokens equal an undisturbed run, an
    authenticated client is served; evidence/bench/conn-flood.json."""
    session.run("python", "-m", "dgr_cert.conn_flood", *session.posargs)


@nox.session(python=False)
def fuzz(session: nox.Session) -> None:
    """libFuzzer (ASan, UBSan) over the worker's request path and the range-ownership GGUF load:
    1M request executions by default (`-- --runs N --seconds S`); JSON to evidence/fuzz/."""
    session.run("python", "-m", "dgr_cert.fuzz", *session.posargs)


@nox.session(python=False)
def certify(session: nox.Session) -> None:
    """Certification records for a lane (`-- --lane cpu`): layout parity in process and over
    workers per model, sealed and bound to descriptor and hardware, into certification/<lane>/."""
    session.run("python", "-m", "dgr_cert.certify", *session.posargs)


@nox.session(name="lane-probe", python=False)
def lane_probe(session: nox.Session) -> None:
    """A non-CPU lane's routes against the CPU lane (`-- --lane vulkan`): NMSE per step, greedy."""
    session.run("python", "-m", "dgr_cert.lane_probe", *session.posargs)


@nox.session(python=False)
def demo(session: nox.Session) -> None:
    """Main job: the default model split into shards, streaming generation and a parity check."""
    session.run("dgr", "demo", *session.posargs)


def _latest_result(story_id: str) -> str | None:
    pointer = ROOT / "evidence" / story_id / "LATEST"
    if not pointer.is_file():
        return None
    run = ROOT / "evidence" / story_id / pointer.read_text(encoding="utf-8").strip()
    result: str = json.loads((run / "evidence.json").read_text(encoding="utf-8"))["result"]
    return result


def _story_session(story_id: str, title: str) -> None:
    def run(session: nox.Session) -> None:
        session.run(
            "dgr-prd", "run-story", story_id, *session.posargs, success_codes=[0, STORY_SKIPPED]
        )
        if _latest_result(story_id) == "skipped":
            session.skip(f"{story_id}: required evidence needs a lane this machine lacks")

    run.__doc__ = title
    nox.session(run, name=f"story-{story_id}", python=False)


for _story in json.loads((ROOT / "prd.json").read_text(encoding="utf-8"))["stories"]:
    _story_session(_story["id"], _story["title"])
