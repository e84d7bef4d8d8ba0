"""DGR-017: the legacy story specs 01..16 are retired and prd.json is the sole authority."""

from __future__ import annotations

import re

from dgr_prd.model import load_prd
from dgr_prd.paths import RepoPaths
from dgr_prd.projections import stale_projections

LEGACY_SPEC = re.compile(r"^(0[1-9]|1[0-6])[-_].*\.md$")
COMPETING_BACKLOGS = ("prd.yaml", "prd.yml", "backlog.json", "backlog.md", "issues")


def problems(paths: RepoPaths) -> list[str]:
    found = []
    for name in COMPETING_BACKLOGS:
        if (paths.root / name).exists():
            found.append(f"{name} competes with prd.json as a backlog; remove it")
    for folder in (paths.root, paths.stories, paths.docs):
        if folder.is_dir():
            found += [
                f"legacy story spec {p.relative_to(paths.root)}"
                for p in folder.iterdir()
                if LEGACY_SPEC.match(p.name)
            ]
    if not paths.prd.is_file():
        return [*found, "prd.json is missing"]
    found += [
        f"projection out of date with prd.json: {s}"
        for s in stale_projections(paths, load_prd(paths.prd))
    ]
    return found
