"""The runtime chain (wire -> route -> serve/cli) imports no planning, bench, certification or
build tool: checked in a fresh interpreter, on what importing each runtime module pulls in."""

from __future__ import annotations

import json
import subprocess
import sys

RUNTIME = [
    "dgr.v1.shard_pb2_grpc",
    "dgr_route.codec",
    "dgr_route.security",
    "dgr_route.session",
    "dgr_route.route",
    "dgr_route.text",
    "dgr_serve.openai_server",
    "dgr_serve.cli",
    "dgr_route.cli",
    "dgr_route.chat",
]
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
FORBIDDEN_MODULES = ("dgr_native.build",)


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
