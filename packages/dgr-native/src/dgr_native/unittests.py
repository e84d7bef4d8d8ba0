"""The worker's C++ unit tests (native/tests, doctest, one ctest case per TEST_CASE): build them
beside the worker and run them with ctest. `--sanitize` builds the worker and the tests under
AddressSanitizer and UndefinedBehaviorSanitizer (any report fails the run) in a build directory of
their own; llama.cpp's libraries stay the plain lane's (not instrumented).

    python -m dgr_native.unittests [--sanitize] [-- ctest args]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from dgr_llamacpp.build import run_step

from dgr_native.build import configure_engine

SANITIZE_FLAGS = (
    "-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
)
# gRPC's and protobuf's process-lifetime singletons are not freed at exit: leak reports of those
# say nothing about the worker, whose per-connection release the tests check by counting
SANITIZE_ENV = {
    "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:halt_on_error=1:strict_string_checks=1",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
}


def build_tests(sanitize: bool) -> Path:
    """Configure and build dgr-worker-tests (and the worker) for the cpu lane; returns the
    build directory."""
    extra = ["-DDGR_BUILD_PYTHON=OFF", "-DDGR_BUILD_TESTS=ON"]
    if sanitize:
        extra += [
            f"-DCMAKE_CXX_FLAGS={SANITIZE_FLAGS}",
            f"-DCMAKE_C_FLAGS={SANITIZE_FLAGS}",
            f"-DCMAKE_EXE_LINKER_FLAGS={SANITIZE_FLAGS}",
            "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
        ]
    out = configure_engine("cpu", "asan" if sanitize else "tests", "cpu", extra)
    targets = ["dgr-worker-tests", "dgr-shard-worker"]
    run_step(["cmake", "--build", str(out), "--target", *targets], sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dgr_native.unittests")
    parser.add_argument("--sanitize", action="store_true", help="ASan + UBSan build")
    parser.add_argument("ctest", nargs="*", help="arguments passed to ctest")
    args = parser.parse_args(argv)
    from dgr_artifacts.models import model_path

    out = build_tests(args.sanitize)
    env = dict(os.environ, DGR_TEST_MODEL=str(model_path()))
    if args.sanitize:
        env.update(SANITIZE_ENV)
    cmd = ["ctest", "--test-dir", str(out), "--output-on-failure", "--timeout", "300", *args.ctest]
    print("+", " ".join(cmd), file=sys.stderr)
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
