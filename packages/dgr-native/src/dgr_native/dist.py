"""`nox -s dist`: the distributable set in dist/, and the proof that it is enough.

- `build_dist`: the dgr-engine wheel (scikit-build-core: the `_dgr_engine` module,
  `dgr-shard-worker` and the patched libllama they link) and a pure-Python wheel for each runtime
  package.
- `check_install`: the README's "Install on a worker machine" block, run as written on those
  wheels in a fresh virtual environment outside the checkout (only the ports differ, and it waits
  for what it starts in the background to listen), then a probe that nothing of the checkout is
  importable there.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dgr_artifacts.downloads import cache_dir
from dgr_prd.metrics import report

from dgr_native.build import workspace
from dgr_native.wheel import UV, build_wheel

# the runtime chain, wire to command line, and the artifacts it verifies and provisions with
RUNTIME = ["dgr-wire", "dgr-route", "dgr-serve", "dgr-cli", "dgr-artifacts"]
# what must and must not be importable where the wheels are installed
PRESENT = ["dgr_engine", "dgr.v1", "dgr_wire", "dgr_route", "dgr_serve", "dgr_cli", "dgr_artifacts"]
ABSENT = ["dgr_native", "dgr_prd", "dgr_llamacpp", "dgr_bench", "dgr_cert", "matplotlib", "nox"]
PRELUDE = """set -euo pipefail
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
ready() {  # a port that accepts connections: what was started with & is up
  for _ in $(seq 1800); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1
  done
  echo "nothing listens on port $1" >&2; return 1
}
"""


def build_dist(out: Path, lane: str = "cpu") -> list[Path]:
    """Build every distributable wheel into `out` (emptied first); returns their paths."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    root = workspace().repo.root
    wheels = [build_wheel(out, lane)]
    for package in RUNTIME:
        subprocess.run(
            [UV, "build", "-q", "--wheel", str(root / "packages" / package), "--out-dir", str(out)],
            check=True,
        )
        (wheel,) = out.glob(f"{package.replace('-', '_')}-*.whl")
        wheels.append(wheel)
    return wheels


def readme_block(readme: Path) -> str:
    """The bash block of the README's "Install on a worker machine" section."""
    text = readme.read_text(encoding="utf-8")
    if "\n## Install on a worker machine\n" not in text:
        raise ValueError(f"{readme} has no 'Install on a worker machine' section")
    section = text.split("\n## Install on a worker machine\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```bash\n(.*?)```", section, re.S)
    if not found:
        raise ValueError(f"{readme}: the install section has no bash block")
    return found.group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def runnable(block: str) -> str:
    """The block with free ports for the README's, and a readiness wait after each command it
    starts in the background (as a person waits for a worker to say it is ready)."""
    ports = re.findall(r"127\.0\.0\.1:(\d{4})\b", block) + re.findall(r"--port (\d{4})\b", block)
    for old in sorted(set(ports)):
        block = re.sub(rf"\b{old}\b", str(_free_port()), block)
    lines = []
    for line in block.splitlines():
        lines.append(line)
        command = line.split("#", 1)[0].rstrip()
        if command.endswith("&"):
            port = re.search(r"(?:--listen 127\.0\.0\.1:|--port )(\d+)", command)
            if not port:
                raise ValueError(f"a background command with no port to wait for: {line}")
            lines.append(f"ready {port.group(1)}")
    return PRELUDE + "\n".join(lines) + "\n"


@dataclass
class InstallRun:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    importable: dict[str, bool]

    def completion_text(self) -> str:
        """The OpenAI server's completion: the last JSON object the block printed."""
        start = self.stdout.rindex('{"id"')
        reply, _ = json.JSONDecoder().raw_decode(self.stdout[start:])
        return str(reply["choices"][0]["text"])


def check_install(wheels: list[Path], machine: Path, readme: Path) -> InstallRun:
    """Run the README block in `machine` (a directory outside any checkout) on `wheels`."""
    (machine / "dist").mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        shutil.copy(wheel, machine / "dist")
    env = {
        # the interpreter this runs under, not the checkout's virtual environment
        "PATH": f"{Path(sys.base_prefix) / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(machine),
        "LANG": "C.UTF-8",
        "DGR_CACHE": str(cache_dir()),  # the model, if this machine fetched it already
        "PIP_CACHE_DIR": str(Path.home() / ".cache" / "pip"),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    t0 = time.perf_counter()
    done = subprocess.run(
        ["bash", "-c", runnable(readme_block(readme))],
        cwd=machine,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    seconds = time.perf_counter() - t0
    importable: dict[str, bool] = {}
    python = machine / "dgr-env" / "bin" / "python"
    if python.is_file():
        probe = "import importlib.util as u, json, sys; "
        probe += "print(json.dumps({m: u.find_spec(m) is not None for m in sys.argv[1:]}))"
        out = subprocess.run(
            [str(python), "-c", probe, *PRESENT, *ABSENT],
            cwd=machine,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        importable = json.loads(out.stdout)
    return InstallRun(done.returncode, done.stdout, done.stderr, seconds, importable)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dgr_native.dist")
    parser.add_argument("--lane", default="cpu")
    parser.add_argument("--check", action="store_true", help="then run the README install block")
    args = parser.parse_args(argv)
    root = workspace().repo.root
    wheels = build_dist(root / "dist", args.lane)
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:8.1f} MiB  {wheel.relative_to(root)}")
    result: dict[str, Any] = {"wheels": {w.name: w.stat().st_size for w in wheels}}
    if args.check:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="dgr-machine-") as tmp:
            run = check_install(wheels, Path(tmp), root / "README.md")
        print(run.stdout[-4000:])
        ok = run.returncode == 0 and all(run.importable.get(m) for m in PRESENT)
        ok = ok and not any(run.importable.get(m) for m in ABSENT)
        if run.returncode != 0:
            print(run.stderr[-4000:], file=sys.stderr)
        print(
            f"README install block on the wheels alone: {'ok' if ok else 'FAILED'} "
            f"in {run.seconds:.0f} s; importable there: {run.importable}"
        )
        result |= {"install_ok": ok, "install_seconds": round(run.seconds, 1)}
        result |= {"importable": run.importable}
        report("dist", result)
        return 0 if ok else 1
    report("dist", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
