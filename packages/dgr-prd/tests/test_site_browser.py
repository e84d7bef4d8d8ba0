"""The evidence site, built strict and opened in headless Chromium as a reviewer would."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from dgr_prd import site
from dgr_prd.evidence import latest_record
from dgr_prd.model import load_prd
from dgr_prd.paths import RepoPaths

pytestmark = pytest.mark.browser

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    if os.environ.get("CI"):
        pytest.fail("Chromium is missing in CI: scripts/bootstrap.sh should have installed it")
    pytest.skip("Chromium is not installed (Debian package `chromium`)")


@pytest.fixture(scope="module")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = RepoPaths(Path(__file__).resolve().parents[3])
    site.generate(repo, load_prd(repo.prd))
    out = tmp_path_factory.mktemp("site")
    subprocess.run(
        ["mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=repo.root,
        check=True,
    )
    return out


@pytest.fixture(scope="module")
def base_url(built_site: Path) -> Iterator[str]:
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(built_site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def browse(url: str, tmp_path: Path, *extra: str) -> str:
    profile = tmp_path / f"profile-{abs(hash(url + ''.join(extra)))}"
    result = subprocess.run(
        [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra, url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def text_of(dom: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))


def test_dashboard_shows_every_story(base_url: str, tmp_path: Path) -> None:
    repo = RepoPaths(Path(__file__).resolve().parents[3])
    prd = load_prd(repo.prd)
    dom = browse(f"{base_url}/generated/dashboard/", tmp_path, "--dump-dom")
    text = text_of(dom)
    assert "Dashboard" in text
    for story in prd.stories:
        assert f'href="../stories/{story.id}/"' in dom, story.id
        assert story.title in text
    assert "55 stories:" in text
    assert 'src="../plots/status.svg"' in dom
    screenshot = tmp_path / "dashboard.png"
    browse(
        f"{base_url}/generated/dashboard/",
        tmp_path,
        f"--screenshot={screenshot}",
        "--window-size=1280,900",
    )
    assert screenshot.stat().st_size > 20_000


def test_story_page_shows_its_evidence(base_url: str, tmp_path: Path) -> None:
    repo = RepoPaths(Path(__file__).resolve().parents[3])
    record = latest_record(repo.evidence, "DGR-017")
    assert record is not None, "DGR-017 evidence is committed with the repository"
    text = text_of(browse(f"{base_url}/generated/stories/DGR-017/", tmp_path, "--dump-dom"))
    assert f"Result: {record.result.value.upper()}" in text
    assert record.run_id in text
    assert record.hardware["cpu"]["model"] in text
    for command in record.commands:
        assert command.name in text
    for heading in ("Latest evidence", "Commands", "Log excerpts", "Handoff", "Run history"):
        assert heading in text


def test_benchmarks_page_lists_each_bench(base_url: str, tmp_path: Path) -> None:
    repo = RepoPaths(Path(__file__).resolve().parents[3])
    benches = sorted(p.stem for p in (repo.evidence / "bench").glob("*.json"))
    text = text_of(browse(f"{base_url}/generated/benchmarks/", tmp_path, "--dump-dom"))
    assert "Benchmarks" in text
    for name in benches:
        assert name in text
