"""What a lane needs beyond the pinned tree, from `native/llama.cpp/lane-deps.json`.

A lane may need system packages (checked, named in the error when missing) and files taken from a
package registry. Those files are downloaded once into $DGR_CACHE/lane-deps, verified against
their sha256 and unpacked there: the Vulkan lane takes newer Vulkan headers than Debian 12 ships
from a Debian 13 package, the CUDA lane its whole toolkit from NVIDIA's wheels on PyPI (the
manifest says why).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

from dgr_artifacts.downloads import cache_dir, pip_download


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
    wheels = spec.get("wheels")
    if wheels is not None:
        tree = unpack_wheels(wheels, spec["wheel_root"], spec.get("links", {}))
        values["root"] = str(tree)
    return [arg.format(**values) for arg in spec.get("cmake", [])]


def wheels_dir(wheels: list[dict[str, str]]) -> Path:
    """Where a set of wheels is unpacked: named by their pinned digests."""
    key = hashlib.sha256("".join(sorted(w["sha256"] for w in wheels)).encode()).hexdigest()
    return cache_dir() / "lane-deps" / f"wheels-{key[:16]}"


def unpack_wheels(wheels: list[dict[str, str]], root: str, links: dict[str, str]) -> Path:
    """The wheels, each verified against its sha256, unpacked into one tree (once); returns the
    tree's `root` (for NVIDIA's wheels nvidia/cu13), with `links` added inside it."""
    out = wheels_dir(wheels)
    done = out / ".unpacked"
    if done.exists():
        return out / root
    downloads = out / "wheels"
    downloads.mkdir(parents=True, exist_ok=True)
    for w in wheels:
        unpack_wheel(fetch_wheel(w["name"], w["version"], w["file"], w["sha256"], downloads), out)
    for link, target in links.items():
        path = out / root / link
        if not (path.parent / target).exists():
            raise LaneDepsError(f"{path}: its target {target} is not in the unpacked wheels")
        path.unlink(missing_ok=True)
        path.symlink_to(target)
    shutil.rmtree(downloads)  # the tree is what the build needs; the wheels are GBs
    done.write_text("".join(f"{w['name']}=={w['version']}\n" for w in wheels))
    return out / root


def fetch_wheel(name: str, version: str, file: str, sha256: str, into: Path) -> Path:
    """`file`, the wheel of `name`==`version` for this machine, from the package index pip is
    configured with, checked against `sha256`."""
    wheel = pip_download(f"{name}=={version}", file, into, sdist=False)
    got = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if got != sha256:
        raise LaneDepsError(f"{file}: sha256 {got}, the manifest pins {sha256}")
    return wheel


def unpack_wheel(wheel: Path, out: Path) -> None:
    """A wheel's files into `out` (its metadata left out), with their permission bits: nvcc and
    the tools it runs must stay executable."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if ".dist-info/" in info.filename or info.is_dir():
                continue
            path = Path(z.extract(info, out))
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(path, mode)


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
