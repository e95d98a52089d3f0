"""The HTML report in a real headless browser (Debian's Chromium): it loads cleanly and the charts are drawn.

Artifacts (page, DOM, screenshot) go to artifacts/reports/ at the repo root (gitignored).
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from jobrunner.reports import Slo, load_report
from jobrunner.reports.html import render_html
from jobrunner.reports.svg import PALETTE
from tests.components import is_ci, missing_component

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--enable-logging=stderr", "--v=0"]
# Chromium's own console lines and load failures; container noise (dbus, ...) is not about the page.
PAGE_PROBLEM = re.compile(r"CONSOLE|Uncaught|Page load failed|ERR_[A-Z_]+")


@pytest.fixture(autouse=True)
def chromium_present() -> None:
    """A skip on a machine without Chromium; a failure under `make test` run as root (which installs it with
    `make browser`) or CI=true. `make test` run as another user cannot install it: a skip with its reason."""
    if not CHROMIUM.exists():
        if os.geteuid() != 0 and not is_ci():
            pytest.skip("needs Debian's Chromium at /usr/bin/chromium, which `make test` installs only as root")
        missing_component("needs Debian's Chromium at /usr/bin/chromium (`make test` installs it as root; "
                          "or: apt-get update && apt-get install -y chromium)")


def _chromium(page: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "chromium-profile"
    command = [str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", *args, page.as_uri()]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture
def page(job_factory: Callable[..., str], artifacts_dir: Path) -> Path:
    """none / int8 / int4 runs side by side, with goodput targets, as one HTML file."""
    urls = [job_factory("none", quantization="none", error_every=40),
            job_factory("int8", quantization="int8", speed=1.5),
            job_factory("int4", quantization="int4", speed=2.2)]
    reports = [load_report(url, worker_hour_usd=2.0, slo=Slo(ttft_s=0.1)) for url in urls]
    path = artifacts_dir / "report.html"
    path.write_text(render_html(reports))
    return path


def test_page_loads_without_errors_and_has_charts(page: Path, tmp_path: Path, artifacts_dir: Path) -> None:
    result = _chromium(page, tmp_path, "--dump-dom")
    (artifacts_dir / "report.dom.html").write_text(result.stdout)
    problems = [line for line in result.stderr.splitlines() if PAGE_PROBLEM.search(line)]
    assert result.returncode == 0, result.stderr[-2000:]
    assert problems == []
    dom = result.stdout
    assert dom.count('<svg class="chart"') == 7  # cost, 2 x tokens/s, 4 latency CDFs
    assert dom.count('<polyline class="series"') == 6 * 3 + 2 * 3  # 6 line charts x 3 runs + 2 average lines
    assert dom.count('<rect class="bar"') == 3 * 3  # input / output / blended per run
    assert "example [int4]" in dom and "n/a" not in dom.split("All figures")[0]
    assert re.findall(r"<script|<link|\b(?:src|href)=", page.read_text()) == []  # self-contained


def test_screenshot_shows_the_charts(page: Path, tmp_path: Path, artifacts_dir: Path) -> None:
    from PIL import Image

    shot = artifacts_dir / "report.png"
    shot.unlink(missing_ok=True)
    result = _chromium(page, tmp_path, f"--screenshot={shot}", "--window-size=1280,2000")
    assert result.returncode == 0 and shot.exists(), result.stderr[-2000:]
    print(f"\nscreenshot: {shot}")
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, 2000)
    for color in PALETTE[:3]:  # each run's line colour is painted
        assert _pixels_near(image, color) > 400, color


def _pixels_near(image: object, hex_color: str, tolerance: int = 24) -> int:
    target = tuple(int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return sum(count for count, rgb in image.getcolors(maxcolors=1 << 20)
               if max(abs(a - b) for a, b in zip(rgb, target, strict=True)) <= tolerance)


@pytest.fixture
def trend_page(job_factory: Callable[..., str], artifacts_dir: Path) -> Path:
    """Five nightly runs of one job as a trend page (the report of `jobrunner report 'nightly/*'`)."""
    import json

    from jobrunner.reports.trend_render import render_trend_html

    reports = []
    for i in range(5):
        url = job_factory(f"nightly-{i}", speed=1.0 + 0.3 * i, error_every=20 if i == 2 else 0)
        manifest_path = Path(url) / "_manifest.json"
        manifest = json.loads(manifest_path.read_text())
        manifest["started_at"] = f"2026-11-{25 + i}T03:00:00+00:00"
        manifest_path.write_text(json.dumps(manifest))
        reports.append(load_report(url, worker_hour_usd=2.0))
    path = artifacts_dir / "trend.html"
    path.write_text(render_trend_html(reports))
    return path


def test_trend_page_draws_a_dot_per_run_on_each_chart(trend_page: Path, tmp_path: Path,
                                                      artifacts_dir: Path) -> None:
    result = _chromium(trend_page, tmp_path, "--dump-dom")
    assert result.returncode == 0 and [line for line in result.stderr.splitlines()
                                       if PAGE_PROBLEM.search(line)] == []
    dom = result.stdout
    # seven charts; JSON-valid share has no dot (no row had a schema), the six others one per night
    assert dom.count('<svg class="chart"') == 7 and dom.count('<circle class="point"') == 6 * 5
    assert "2026-11-25" in dom and "2026-11-29" in dom and dom.count("n/a") == 5  # JSON valid: no schema
    shot = artifacts_dir / "trend.png"
    shot.unlink(missing_ok=True)
    result = _chromium(trend_page, tmp_path, f"--screenshot={shot}", "--window-size=1280,1700")
    assert result.returncode == 0 and shot.exists(), result.stderr[-2000:]
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    for color in PALETTE[:4] + PALETTE[5:6]:  # each trend figure's line and dots are painted (6: black, as text)
        assert _pixels_near(image, color) > 150, color
