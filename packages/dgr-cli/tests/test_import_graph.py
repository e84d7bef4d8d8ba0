"""The runtime chain (wire -> route -> serve/cli) imports no planning, bench, certification or
build tool: checked in a fresh interpreter, on what importing each runtime module pulls in."""

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


def imported_by(module: str) -> list[str]:
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded: list[str] = json.loads(out.stdout)
    return loaded


def test_runtime_modules_import_no_tooling() -> None:
    for module in RUNTIME:
        loaded = imported_by(module)
        assert module in loaded
        bad = [
            m
            for m in loaded
            if m.split(".")[0] in FORBIDDEN_PACKAGES or m.startswith(FORBIDDEN_MODULES)
        ]
        assert bad == [], f"importing {module} pulls in {bad}"


def test_the_check_sees_a_tooling_import() -> None:
    # the same probe on a bench module finds what it must (so the test above can fail)
    loaded = imported_by("dgr_bench.bench")
    assert "dgr_prd" in {m.split(".")[0] for m in loaded}


def test_runtime_distributions_require_no_tooling() -> None:
    # what `pip install` of the runtime wheels pulls in, read from their installed metadata
    for dist in RUNTIME_DISTRIBUTIONS:
        names = {re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0] for r in requires(dist) or []}
        assert names & FORBIDDEN_DISTRIBUTIONS == set(), f"{dist} requires {names}"
        assert names - FORBIDDEN_DISTRIBUTIONS, f"{dist}: no requirements read"
