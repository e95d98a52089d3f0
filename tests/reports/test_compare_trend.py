"""Reports that compare runs (labels, spec differences, hardware/date/version/dtype, tiles, percentile grid,
start-up shading, every run's headline figures) and a series of runs as a trend (glob of outputs), plus CSV."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

from click.testing import CliRunner
from report_outputs import write_job

from jobrunner.cli import main

NIGHTS = ("2026-11-26", "2026-11-27", "2026-11-28", "2026-11-29", "2026-11-30")


def _patch_manifest(url: str, **changes) -> None:
    path = Path(url) / "_manifest.json"
    manifest = json.loads(path.read_text())
    for key, value in changes.items():
        if key == "spec":
            manifest["spec"] = {**manifest["spec"], **value}
        elif key == "workers":
            for worker in manifest["workers"].values():
                worker.update(value)
        else:
            manifest[key] = value
    path.write_text(json.dumps(manifest))


def _two_runs(tmp_path: Path) -> list[str]:
    a = write_job(str(tmp_path / "a"))
    b = write_job(str(tmp_path / "b"), speed=2.0)
    _patch_manifest(a, spec={"sampling": {"max_tokens": 64}, "model": {"dtype": "float32"}},
                    workers={"cpu_model": "Intel(R) Xeon(R) Platinum 8481C", "gpu_name": "", "device": "cpu"})
    _patch_manifest(b, spec={"sampling": {"max_tokens": 128}, "model": {"dtype": "float32"}},
                    workers={"cpu_model": "AMD EPYC 9R14", "gpu_name": "NVIDIA L4", "device": "cuda:0",
                             "node_id": "n1"},
                    started_at="2026-11-30T04:00:00+00:00", jobrunner_version="0.2.0")
    return [a, b]


def _report(*args: str) -> str:
    result = CliRunner().invoke(main, ["report", *args, "--worker-hour-usd", "2.0"])
    assert result.exit_code == 0, result.output
    return result.output


def test_labels_spec_differences_and_run_header_in_text_and_json(tmp_path: Path) -> None:
    a, b = _two_runs(tmp_path)
    text = _report(a, b, "--label", "baseline", "--label", "fast")
    assert re.search(r"^\s+baseline\s+fast$", text.splitlines()[0])
    assert "spec differences:" in text and "sampling.max_tokens: baseline=64, fast=128" in text
    assert re.search(r"date\s+2026-11-30\s+2026-11-30", text)
    assert re.search(r"hardware\s+Intel\(R\) Xeon\(R\) Platinum 8481C \(CPU\)\s+1 x NVIDIA L4", text)
    assert re.search(r"jobrunner version\s+0\.1\.0\s+0\.2\.0", text) and re.search(r"dtype\s+float32\s+float32", text)

    document = json.loads(_report(a, b, "--label", "baseline", "--label", "fast", "--format", "json"))
    assert [r["run"]["label"] for r in document["runs"]] == ["baseline", "fast"]
    assert document["spec_differences"] == {"sampling.max_tokens": [64, 128]}
    fast = document["runs"][1]["run"]
    assert fast["hardware"]["gpus"] == {"NVIDIA L4": 1} and fast["hardware"]["num_gpus"] == 1
    assert fast["date"] == "2026-11-30" and fast["started_at"] == "2026-11-30T04:00:00+00:00"
    assert fast["model"]["dtype"] == "float32" and 0 < fast["startup_end_s"] < 1


def test_more_labels_than_outputs_is_refused(tmp_path: Path) -> None:
    a = write_job(str(tmp_path / "a"))
    result = CliRunner().invoke(main, ["report", a, "--label", "x", "--label", "y"])
    assert result.exit_code == 2 and "2 labels for 1 output(s)" in result.output


def test_html_shows_every_runs_tiles_the_grid_and_the_start_up(tmp_path: Path) -> None:
    a, b = _two_runs(tmp_path)
    page = _report(a, b, "--label", "baseline", "--label", "fast", "--format", "html")
    assert page.count('<div class="run-cards">') == 2  # headline tiles for each run, not only the first
    assert page.count(">job cost</div>") == 2 and page.count(">wall time</div>") == 2
    tiles = re.findall(r'<div class="v">([^<]+)</div><div class="k">wall time</div>', page)
    assert len(tiles) == 2 and tiles[0] != tiles[1]
    grid = page.split('<table class="grid">')[1].split("</table>")[0]
    assert grid.count("<th>p50</th>") == 2 and grid.count("<th>p99</th>") == 2 and "time to first token" in grid
    assert page.count('<g class="band">') == 4  # start-up of both runs on both tokens/s charts
    assert "baseline: start-up" in page and "1 x NVIDIA L4" in page and "jobrunner 0.2.0" in page
    diff = page.split('<table class="spec-diff">')[1].split("</table>")[0]
    assert "sampling.max_tokens" in diff and ">64<" in diff and ">128<" in diff


def _nightly(tmp_path: Path) -> Path:
    root = tmp_path / "nightly"
    for i, night in enumerate(NIGHTS):
        url = write_job(str(root / night), speed=1.0 + 0.25 * i, error_every=0 if i % 2 else 25)
        _patch_manifest(url, started_at=f"{night}T03:00:00+00:00")
    (root / "not-an-output").mkdir()
    return root


def test_a_glob_of_outputs_is_a_trend_by_run_date(tmp_path: Path) -> None:
    root = _nightly(tmp_path)
    text = _report(f"{root}/*")
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["date", "run"] and len(lines) == 1 + len(NIGHTS)
    assert [line.split()[0] for line in lines[1:]] == list(NIGHTS)
    points = json.loads(_report(f"{root}/*", "--format", "json"))["trend"]
    assert [p["date"] for p in points] == list(NIGHTS)
    speeds = [p["tokens_per_s"] for p in points]
    assert speeds == sorted(speeds) and all(p["usd_per_m_tokens"] > 0 for p in points)
    assert [p["error_rate"] > 0 for p in points] == [True, False, True, False, True]
    assert all(0 < p["prefix_cache_hit_rate"] < 1 for p in points)
    page = _report(f"{root}/*", "--format", "html")
    # 7 charts; JSON-valid share has no dot (no row had a schema), the other six one per night
    assert page.count('<svg class="chart"') == 7 and page.count('<circle class="point"') == 6 * len(NIGHTS)
    assert "no row had a JSON schema" in page and "5 runs from 2026-11-26 to 2026-11-30" in page


def test_compare_overrides_the_glob_default_and_csv_has_a_row_per_run(tmp_path: Path) -> None:
    root = _nightly(tmp_path)
    side_by_side = _report(f"{root}/*", "--compare", "--format", "md")
    assert side_by_side.startswith("# jobrunner report") and side_by_side.count(" | ") > 10
    rows = list(csv.DictReader(io.StringIO(_report(f"{root}/*", "--format", "csv"))))
    assert [r["date"] for r in rows] == list(NIGHTS)
    assert all(float(r["cost: $ / M tokens (blended)"]) > 0 and int(r["rows: rows"]) == 1000 for r in rows)
    assert rows[0]["url"].endswith("nightly/2026-11-26")


def test_a_glob_that_matches_no_output_says_so(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["report", f"{tmp_path}/nothing-*"])
    assert result.exit_code == 1 and "matches no job output" in result.output


def test_the_output_root_or_the_templated_url_is_a_trend_of_the_nights_under_it(tmp_path: Path) -> None:
    root = _nightly(tmp_path)
    by_glob = json.loads(_report(f"{root}/*", "--format", "json"))["trend"]
    for given in (str(root), f"{root}/", f"{root}/{{date}}"):  # the root, or the output.url as the spec has it
        points = json.loads(_report(given, "--format", "json"))["trend"]
        assert [p["date"] for p in points] == list(NIGHTS) and points == by_glob, given
    one_night = json.loads(_report(f"{root}/{NIGHTS[0]}", "--format", "json"))  # an output itself: one report
    assert "trend" not in one_night and one_night["rows"]["total"] == 1000
