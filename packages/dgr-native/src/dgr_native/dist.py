"""`nox -s dist`: the distributable set in dist/, and the proof that it is enough.

- `build_dist`: the dgr-engine wheel (scikit-build-core: the `_dgr_engine` module,
  `dgr-shard-worker` and the patched libllama they link) and a pure-Python wheel for each runtime
  package, `dgr plan` and `dgr bench` included (none requires the planning or build tools).
- `check_install`: the README's "Install on a worker machine" block, run as written on those
  wheels in a fresh virtual environment outside the checkout (only the ports differ, and it waits
  for what it starts in the background to listen), then a probe that nothing of the checkout is
  importable there.
- `wheelhouse` and `check_container`: the dependencies' wheels in dist/deps, and the worker image
  of `Containerfile` built from dist/ with Debian's podman, a worker started from it (buildah's
  chroot isolation: this VM's OCI runtime cannot set rlimits) and asked for its health and a
  generation. The base image comes from the Debian archive (mmdebstrap) when no registry holding
  one is reachable.
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
from dgr_records import report

from dgr_native.build import workspace
from dgr_native.wheel import UV, build_wheel

# the runtime chain, wire to command line, and the artifacts it verifies and provisions with;
# then `dgr plan` and `dgr bench` (the planner, its tracker inputs, the benches, and how they
# record what they measured)
RUNTIME = ["dgr-wire", "dgr-route", "dgr-serve", "dgr-cli", "dgr-artifacts"]
RUNTIME_TOOLS = ["dgr-records", "dgr-meshnet", "dgr-placement", "dgr-bench"]
# what must and must not be importable where the wheels are installed
PRESENT = ["dgr_engine", "dgr.v1", "dgr_wire", "dgr_route", "dgr_serve", "dgr_cli", "dgr_artifacts"]
PRESENT += ["dgr_records", "dgr_meshnet", "dgr_placement", "dgr_bench"]
ABSENT = ["dgr_native", "dgr_prd", "dgr_llamacpp", "dgr_cert", "matplotlib", "nox"]
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
    for package in RUNTIME + RUNTIME_TOOLS:
        subprocess.run(
            [UV, "build", "-q", "--wheel", str(root / "packages" / package), "--out-dir", str(out)],
            check=True,
        )
        (wheel,) = out.glob(f"{package.replace('-', '_')}-*.whl")
        wheels.append(wheel)
    return wheels


def wheelhouse(out: Path) -> Path:
    """The runtime's dependencies as wheels in out/deps, for an install that reaches no index."""
    deps = out / "deps"
    shutil.rmtree(deps, ignore_errors=True)
    ours = sorted(out.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary", ":all:", "-d", str(deps)]
    subprocess.run([*cmd, *map(str, ours)], check=True)
    for wheel in deps.glob("dgr_*.whl"):
        wheel.unlink()
    return deps


def _base_image() -> str:
    """A Debian 12 image in local storage: localhost/dgr-debian:12, made once from the Debian
    archive with mmdebstrap and imported (podman pulls nothing)."""
    name = "localhost/dgr-debian:12"
    if subprocess.run(["podman", "image", "exists", name], check=False).returncode == 0:
        return name
    tar = cache_dir() / "container" / "debian-12-minbase.tar"
    if not tar.is_file():
        tar.parent.mkdir(parents=True, exist_ok=True)
        mirror = "http://deb.debian.org/debian"
        sources = [f"deb {mirror} bookworm main", f"deb {mirror} bookworm-updates main"]
        sources.append("deb http://deb.debian.org/debian-security bookworm-security main")
        cmd = ["mmdebstrap", "--variant=minbase", "-q", "bookworm", str(tar), *sources]
        subprocess.run(cmd, check=True)
    subprocess.run(["podman", "import", "-q", str(tar), name], check=True, capture_output=True)
    return name


def check_container(
    out: Path, model: Path, layers: str = "0:30", tag: str = "localhost/dgr-worker:dist"
) -> dict[str, Any]:
    """Build the worker image from `out` (wheels and deps/), start a worker of `layers` (the whole
    default model) from it, and ask it for health and a generation from inside the image."""
    missing = [t for t in ("podman", "buildah", "mmdebstrap") if shutil.which(t) is None]
    if missing:
        raise RuntimeError(
            f"{', '.join(missing)} not installed (apt-get install {' '.join(missing)})"
        )
    root = workspace().repo.root
    base = _base_image()
    t0 = time.perf_counter()
    build = ["podman", "build", "-q", "--isolation=chroot", "--network=host"]
    build += ["--build-arg", f"BASE={base}", "-f", str(root / "Containerfile"), "-t", tag, str(out)]
    subprocess.run(build, check=True, capture_output=True)
    built_s = time.perf_counter() - t0
    container = subprocess.run(
        ["buildah", "from", "--pull=never", tag], check=True, capture_output=True, text=True
    ).stdout.strip()
    run = ["buildah", "run", "--isolation", "chroot", "--network", "host"]
    port = _free_port()
    # the image declares /models a volume, which buildah's chroot run shadows: mount elsewhere
    serve = ["--listen", f"127.0.0.1:{port}", "--model", f"/mnt/models/{model.name}"]
    serve += ["--layers", layers]
    worker = subprocess.Popen(
        [*run, "-v", f"{model.parent}:/mnt/models:ro", container, "--", "dgr", "worker", *serve],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        health = ""
        for _ in range(120):
            done = subprocess.run(
                [*run, container, "--", "dgr", "health", f"127.0.0.1:{port}", "--timeout", "1"],
                capture_output=True,
                text=True,
                check=False,
            )
            health = done.stdout.strip() or done.stderr.strip()
            if done.returncode == 0 or worker.poll() is not None:
                break
            time.sleep(1)
        ask = ["--route", f"127.0.0.1:{port}", "--max-tokens", "12", "The capital of France is"]
        generated = subprocess.run(
            [*run, container, "--", "dgr", "generate", *ask],
            capture_output=True,
            text=True,
            check=False,
        )
        user = subprocess.run(
            [*run, container, "--", "id", "-u"], capture_output=True, text=True, check=True
        ).stdout.strip()
    finally:
        worker.terminate()
        log = worker.communicate(timeout=30)[0]
        subprocess.run(["buildah", "rm", container], check=False, capture_output=True)
    return {
        "base": base,
        "build_seconds": round(built_s, 1),
        "user": user,
        "health": health,
        "generated": generated.stdout.strip(),
        "generate_rc": generated.returncode,
        "worker_log_tail": log.strip().splitlines()[-3:],
    }


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
    parser.add_argument("--deps", action="store_true", help="the dependencies' wheels in deps/")
    parser.add_argument("--check", action="store_true", help="then run the README install block")
    parser.add_argument(
        "--container", action="store_true", help="then build the worker image and run a worker"
    )
    args = parser.parse_args(argv)
    root = workspace().repo.root
    wheels = build_dist(root / "dist", args.lane)
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:8.1f} MiB  {wheel.relative_to(root)}")
    result: dict[str, Any] = {"wheels": {w.name: w.stat().st_size for w in wheels}}
    ok = True
    if args.deps or args.container:
        deps = sorted(wheelhouse(root / "dist").glob("*.whl"))
        print(f"{len(deps)} dependency wheels in dist/deps")
        result["dependency_wheels"] = len(deps)
    if args.check:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="dgr-machine-") as tmp:
            run = check_install(wheels, Path(tmp), root / "README.md")
        print(run.stdout[-4000:])
        installed = run.returncode == 0 and all(run.importable.get(m) for m in PRESENT)
        installed = installed and not any(run.importable.get(m) for m in ABSENT)
        if run.returncode != 0:
            print(run.stderr[-4000:], file=sys.stderr)
        print(
            f"README install block on the wheels alone: {'ok' if installed else 'FAILED'} "
            f"in {run.seconds:.0f} s; importable there: {run.importable}"
        )
        result |= {"install_ok": installed, "install_seconds": round(run.seconds, 1)}
        result |= {"importable": run.importable}
        ok = ok and installed
    if args.container:
        from dgr_artifacts.models import model_path

        image = check_container(root / "dist", model_path())
        print(json.dumps(image, indent=2))
        served = image["health"].endswith(": SERVING") and image["generate_rc"] == 0
        served = served and bool(image["generated"]) and image["user"] not in ("", "0")
        print(f"worker image: {'ok' if served else 'FAILED'}")
        result["container"] = image | {"ok": served}
        ok = ok and served
    report("dist", result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
