"""native-wheel: build the dgr-engine wheel with scikit-build-core from the patched tree, install
it into a fresh virtual environment, and check it computes exactly what the development build
computes (same logits, bit for bit, through a two-stage chain)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from dgr_llamacpp.build import build_root
from dgr_llamacpp.fetch import fetch
from dgr_llamacpp.patches import apply_stack
from dgr_llamacpp.workspace import open_workspace
from dgr_records import report

from dgr_native import load
from dgr_native.build import build_identity, checkout_key, engine_source

UV = os.environ.get("UV", "uv")  # `uv run` names its own executable here

CHECK = """
import json, sys
import numpy as np
from dgr_engine import _dgr_engine as m
model = sys.argv[1]
head, tail = m.Engine(model, 0, 15, n_ctx=256, n_batch=64, max_sessions=1), \\
    m.Engine(model, 15, -1, n_ctx=256, n_batch=64, max_sessions=1)
tokens = np.asarray(head.tokenize("A wheel that runs", True), dtype=np.int32)
logits = tail.forward(1, 1, 0, boundary=head.forward(1, 1, 0, tokens=tokens))
print(json.dumps({"file": m.__file__, "logits": logits[0].view(np.uint32).tolist()}))
"""


def build_wheel(out_dir: Path, lane: str = "cpu") -> Path:
    ws = open_workspace()
    patched, _ = apply_stack(fetch(ws.pin, ws.root), ws.patched, ws.patches)
    source = engine_source(ws.repo.root)
    build = build_root() / f"wheel-{ws.pin.commit[:12]}-{checkout_key(source)}-{lane}"
    cmd = [
        UV,
        "build",
        "--wheel",
        str(source),
        "--out-dir",
        str(out_dir),
        "-C",
        f"cmake.define.DGR_LLAMA_SOURCE={patched}",
        *(a for k, v in build_identity(lane).items() for a in ("-C", f"cmake.define.{k}={v}")),
        "-C",
        f"build-dir={build}",
    ]
    subprocess.run(cmd, check=True)
    (wheel,) = out_dir.glob("dgr_engine-*.whl")
    return wheel


def main() -> int:
    from dgr_artifacts.models import model_path

    model = model_path()
    with tempfile.TemporaryDirectory(prefix="dgr-wheel-") as tmp:
        wheel = build_wheel(Path(tmp) / "dist")
        venv = Path(tmp) / "venv"
        subprocess.run([UV, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
        subprocess.run(
            [UV, "pip", "install", "-q", "--python", str(venv / "bin" / "python"), str(wheel)],
            check=True,
        )
        out = subprocess.run(
            [str(venv / "bin" / "python"), "-c", CHECK, str(model)],
            capture_output=True,
            text=True,
            check=False,
            cwd=tmp,
        )
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            print("the installed wheel failed its check", file=sys.stderr)
            return 1
        from_wheel = json.loads(out.stdout.strip().splitlines()[-1])
    dev = load()
    head = dev.Engine(str(model), 0, 15, n_ctx=256, n_batch=64, max_sessions=1)
    tail = dev.Engine(str(model), 15, -1, n_ctx=256, n_batch=64, max_sessions=1)
    tokens = np.asarray(head.tokenize("A wheel that runs", True), dtype=np.int32)
    logits = tail.forward(1, 1, 0, boundary=head.forward(1, 1, 0, tokens=tokens))
    same = logits[0].view(np.uint32).tolist() == from_wheel["logits"]
    print(
        f"wheel {wheel.name}: module {from_wheel['file']}; logits equal to the development "
        f"build: {same}"
    )
    report("wheel", {"wheel": wheel.name, "equal_to_dev_build": same})
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
