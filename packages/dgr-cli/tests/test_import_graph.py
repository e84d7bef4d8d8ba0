"""The runtime chain (wire -> route -> serve/cli) imports no planning, bench, certification or
build tool, and `dgr plan` / `dgr bench` (the planner and the benches) import no planning,
certification or build tool: checked in a fresh interpreter, on what importing each module pulls
in, and on the installed distributions' requirements (what `pip install` of the wheels pulls)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib.metadata import requires

RUNTIME = [
    "dgr.v1.shard_pb2_grpc",
    "dgr_wire.codec",
    "dgr_route.engine",
    "dgr_route.local",
    "dgr_route.security",
    "dgr_route.session",
    "dgr_route.route",
    "dgr_route.text",
    "dgr_route.tokenizer",
    "dgr_serve.openai_server",
    "dgr_cli",
    "dgr_cli.commands",
    "dgr_cli.chat",
    "dgr_cli.demo",
    "dgr_cli.serve",
    "dgr_cli.workers",
    "dgr_artifacts.cli",
    "dgr_artifacts.models",
]
# the distributions a worker machine installs, and what none of them may require
RUNTIME_DISTRIBUTIONS = ["dgr-wire", "dgr-route", "dgr-serve", "dgr-cli", "dgr-artifacts"]
FORBIDDEN_PACKAGES = {
    "dgr_prd",
    "dgr_cert",
    "dgr_bench",
    "dgr_placement",
    "dgr_llamacpp",
    "matplotlib",
    "nox",
    "mkdocs",
}
FORBIDDEN_MODULES = ("dgr_native",)
FORBIDDEN_DISTRIBUTIONS = {
    "dgr-prd",
    "dgr-cert",
    "dgr-bench",
    "dgr-placement",
    "dgr-llamacpp",
    "dgr-native",
    "dgr-meshnet",
    "matplotlib",
    "nox",
}

# `dgr plan` and `dgr bench`: they may use the runtime, not the planning or build tools
TOOLS = [
    "dgr_placement.cli",
    "dgr_placement.planner",
    "dgr_placement.profile",
    "dgr_bench.cli",
    "dgr_bench.bench",
    "dgr_bench.plan",
    "dgr_records",
]
TOOLS_DISTRIBUTIONS = ["dgr-records", "dgr-meshnet", "dgr-placement", "dgr-bench"]
TOOLS_FORBIDDEN_PACKAGES = FORBIDDEN_PACKAGES - {"dgr_bench", "dgr_placement"}
TOOLS_FORBIDDEN_DISTRIBUTIONS = FORBIDDEN_DISTRIBUTIONS - {
    "dgr-bench",
    "dgr-placement",
    "dgr-meshnet",
}


def imported_by(module: str) -> list[str]:
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded: list[str] = json.loads(out.stdout)
    return loaded


def forbidden_imports(module: str, packages: set[str]) -> list[str]:
    loaded = imported_by(module)
    assert module in loaded
    return [m for m in loaded if m.split(".")[0] in packages or m.startswith(FORBIDDEN_MODULES)]


def test_runtime_modules_import_no_tooling() -> None:
    for module in RUNTIME:
        assert forbidden_imports(module, FORBIDDEN_PACKAGES) == [], module


def test_plan_and_bench_import_no_planning_or_build_tool() -> None:
    for module in TOOLS:
        assert forbidden_imports(module, TOOLS_FORBIDDEN_PACKAGES) == [], module


def test_the_check_sees_a_tooling_import() -> None:
    # the same probe on a certification module finds what it must (so the tests above can fail)
    found = forbidden_imports("dgr_cert.certify", TOOLS_FORBIDDEN_PACKAGES)
    assert {"dgr_prd", "dgr_llamacpp", "dgr_native"} <= {m.split(".")[0] for m in found}


def required(dist: str) -> set[str]:
    """The distributions `pip install` of `dist` pulls in (extras it declares left out)."""
    reqs = [r for r in requires(dist) or [] if "extra ==" not in r]
    return {re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0] for r in reqs}


def test_runtime_distributions_require_no_tooling() -> None:
    # what `pip install` of the runtime wheels pulls in, read from their installed metadata
    for dist in RUNTIME_DISTRIBUTIONS:
        names = required(dist)
        assert names & FORBIDDEN_DISTRIBUTIONS == set(), f"{dist} requires {names}"
        assert names - FORBIDDEN_DISTRIBUTIONS, f"{dist}: no requirements read"


def test_plan_and_bench_distributions_require_no_planning_or_build_tool() -> None:
    for dist in TOOLS_DISTRIBUTIONS:
        assert required(dist) & TOOLS_FORBIDDEN_DISTRIBUTIONS == set(), dist
    # dgr-bench's gate benches compare with llama.cpp's builds: an extra, not a requirement
    assert {"dgr-native", "dgr-llamacpp"} <= {
        re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0] for r in requires("dgr-bench") or []
    }
