"""What a lane needs beyond the pinned tree, from `native/llama.cpp/lane-deps.json`.

A lane may need system packages (checked, named in the error when missing) and files taken from a
package registry. Those files are downloaded once into $DGR_CACHE/lane-deps, verified against
their sha256 and unpacked there. Today only the Vulkan lane has any: newer Vulkan headers than
Debian 12 ships (the manifest says why).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from dgr_artifacts.downloads import cache_dir


class LaneDepsError(Exception):
    pass


def manifest(root: Path) -> dict[str, Any]:
    path = root / "native" / "llama.cpp" / "lane-deps.json"
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def lane_cmake_args(root: Path, lane: str) -> list[str]:
    """The CMake arguments `lane` adds, after checking its tools and fetching its files."""
    spec = manifest(root).get(lane)
    if spec is None:
        return []
    missing = [t for t in spec.get("tools", []) if shutil.which(t) is None]
    if missing:
        packages = " ".join(spec.get("system_packages", []))
        raise LaneDepsError(
            f"the {lane} lane needs {', '.join(missing)}: apt-get install {packages}"
        )
    values: dict[str, str] = {}
    deb = spec.get("deb")
    if deb is not None:
        values["include"] = str(unpack_deb(deb["url"], deb["sha256"]) / deb["include"])
    return [arg.format(**values) for arg in spec.get("cmake", [])]


def unpack_deb(url: str, sha256: str) -> Path:
    """The .deb at `url`, verified and unpacked under $DGR_CACHE/lane-deps/<sha256>/ (once)."""
    out = cache_dir() / "lane-deps" / sha256
    done = out / ".unpacked"
    if done.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    deb = out / Path(url).name
    with urllib.request.urlopen(url, timeout=120) as response:
        data = response.read()
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise LaneDepsError(f"{url}: sha256 {got}, the manifest pins {sha256}")
    deb.write_bytes(data)
    if shutil.which("dpkg-deb") is None:
        raise LaneDepsError("unpacking a .deb needs dpkg-deb (Debian's dpkg)")
    subprocess.run(["dpkg-deb", "-x", str(deb), str(out)], check=True)
    done.write_text(url + "\n")
    return out
