"""Nights of an incremental job as a trend: keyed by each run's logical date ({date} / $JOBRUNNER_DATE, recorded
in its manifest), not by the clock; a night with nothing to do is a valid empty report and a point of 0 rows;
`status` of a job spec finds tonight's folder; latency axes carry the unit their ticks are in."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner
from report_outputs import SCHEMA, make_manifest, make_rows, write_job, write_outputs

from jobrunner.cli import main
from jobrunner.reports import load_report
from jobrunner.reports.charts import latency_cdf_chart
from jobrunner.reports.svg import nice_ticks
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import fake_spec

# night -> (rows, every k-th row not schema-valid JSON); the runs started on one morning, the latest night first
NIGHTS = {"2026-12-01": (6, 3), "2026-12-02": (8, 4), "2026-12-03": (10, 0)}
STARTED = {"2026-12-01": "2026-12-06T01:09:00+00:00", "2026-12-02": "2026-12-06T01:08:00+00:00",
           "2026-12-03": "2026-12-06T01:07:00+00:00"}


def _fake_night(root: Path, night: str) -> list[str]:
    """A finished night under root/<night> whose manifest says it ran for `night`; returns its ids."""
    num_rows, invalid_every = NIGHTS[night]
    shard = f"n{night[-2:]}"
    rows = make_rows(num_rows, shard, "w0", seed=int(night[-2:]))
    manifest = make_manifest({shard: rows}, wall_s=10.0, job_name="nightly", worker_hour_usd=1.0)
    manifest.update(logical_date=night, started_at=STARTED[night])
    url = write_outputs(str(root / night), {shard: rows}, manifest)
    valid = [not (invalid_every and i % invalid_every == 0) for i in range(num_rows)]
    table = pa.Table.from_pydict(rows, schema=SCHEMA).append_column("json_valid", pa.array(valid))
    pq.write_table(table, f"{url}/parts/part-{shard}.parquet")
    return rows["id"]


def _spec_file(tmp_path: Path, root: Path, input_path: Path) -> Path:
    spec = fake_spec(str(input_path), f"{root}/{{date}}", cluster={"num_workers": 1},
                     output={"mode": "incremental", "skip_done_from": [f"{root}/*"]}, cost={"worker_hour_usd": 1.0})
    spec["name"] = "nightly"
    path = tmp_path / "nightly.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _cli(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture
def nights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, str]:
    """Three faked nights, then a real `jobrunner run` for 2026-12-04 whose input holds only their ids."""
    root = tmp_path / "nightly"
    ids = [i for night in NIGHTS for i in _fake_night(root, night)]
    input_path = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"id": ids, "prompt": [f"question {i}" for i in ids], "topic": ["t"] * len(ids)}),
                   input_path)
    spec_path = _spec_file(tmp_path, root, input_path)
    monkeypatch.setenv("JOBRUNNER_DATE", "2026-12-04")
    monkeypatch.chdir(tmp_path)
    run_output = _cli("run", str(spec_path), "--no-progress")
    return root, spec_path, run_output


def test_a_night_with_nothing_to_do_writes_an_empty_report_and_a_dated_manifest(nights) -> None:
    root, _, run_output = nights
    assert "taking 0 of 24 input rows; 24 skipped as done" in run_output
    assert "report not written" not in run_output and "_report/report.html" in run_output
    night = root / "2026-12-04"
    manifest = json.loads((night / "_manifest.json").read_text())
    assert manifest["logical_date"] == "2026-12-04" and (night / "_SUCCESS").exists()
    report = json.loads((night / "_report" / "report.json").read_text())
    assert report["run"]["date"] == "2026-12-04" and report["rows"]["total"] == 0
    assert report["rows"]["error_rate"] is None and report["cost"]["total_usd"] == 0
    assert "nothing to do: the run took 0 of 24 input rows (24 done already); a valid output of 0 rows" in \
        report["warnings"]
    assert load_report(str(night))["time"]["worker_seconds"] == 0
    page = (night / "_report" / "report.html").read_text()
    assert page.count("0 rows: nothing to chart") == 7 and "every row failed?" not in page and "no cost:" not in page


def test_the_trend_is_four_nights_in_logical_date_order(nights) -> None:
    root, _, _ = nights
    points = json.loads(_cli("report", f"{root}/*", "--format", "json"))["trend"]
    assert [p["date"] for p in points] == ["2026-12-01", "2026-12-02", "2026-12-03", "2026-12-04"]
    assert [p["rows"] for p in points] == [6, 8, 10, 0]
    assert [p["json_valid_rate"] for p in points] == [4 / 6, 6 / 8, 1.0, None]
    length = [sum(r == "length" for r in make_rows(n, f"n{d[-2:]}", "w0", seed=int(d[-2:]))["finish_reason"]) / n
              for d, (n, _) in NIGHTS.items()]
    assert [p["stopped_at_max_tokens_rate"] for p in points] == [*length, None]
    assert [p["error_rate"] for p in points] == [0.0, 0.0, 0.0, None]
    assert all(p["usd_per_m_tokens"] > 0 for p in points[:3]) and points[3]["usd_per_m_tokens"] is None
    assert points[3]["tokens_per_s"] is None and points[3]["job_cost_usd"] == 0

    page = _cli("report", f"{root}/*", "--format", "html")
    ticks = re.findall(r'<text class="tick" x="[\d.]+" y="256" text-anchor="middle">([^<]+)</text>', page)
    assert ticks[:4] == ["2026-12-01", "2026-12-02", "2026-12-03", "2026-12-04"]  # the x axis of the first chart
    assert "12-06 01:0" not in page  # no wall-clock tick
    titles = re.findall(r'<text class="chart-title"[^>]*>([^<]+)</text>', page)
    assert titles == ["rows per night", "$ / M tokens (blended)", "error share (rows)",
                      "share stopped at max_tokens", "JSON-valid share (rows with a schema)",
                      "tokens/s (input + output)", "prefix-cache hit rate"]
    # the empty night is a dot on `rows` only: the other charts have a dot for each of the three nights
    assert page.count('<circle class="point"') == 4 + 6 * 3
    assert "4 runs from 2026-12-01 to 2026-12-04" in page and "0 rows (nothing to do, or nothing committed): " \
        "2026-12-04" in page


def test_status_of_the_spec_finds_tonights_folder(nights, monkeypatch: pytest.MonkeyPatch) -> None:
    root, spec_path, _ = nights
    text = _cli("status", str(spec_path))
    assert re.search(r"^output\s+" + re.escape(f"{root}/2026-12-04") + "$", text, re.M)
    assert re.search(r"^state\s+complete", text, re.M)
    monkeypatch.setenv("JOBRUNNER_DATE", "2026-12-05")  # a night that has not run yet
    result = CliRunner().invoke(main, ["status", str(spec_path)])
    assert result.exit_code == 1 and f"{root}/2026-12-05: no _manifest.json" in result.output


def test_status_refuses_a_spec_whose_output_is_new_every_run(tmp_path: Path) -> None:
    spec = fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out" / "{run_id}"))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(main, ["status", str(tmp_path / "job.yaml")])
    assert result.exit_code == 1 and "holds {run_id}, new at every run: give the run's output URL" in result.output


def test_a_night_not_committed_yet_is_left_out_of_the_trend_with_a_warning(tmp_path: Path) -> None:
    root = tmp_path / "nightly"
    for night in NIGHTS:
        _fake_night(root, night)
    rows = make_rows(3, "s0", "w0")
    manifest = make_manifest({"s0": rows}, 1.0, job_name="nightly")
    manifest["shards"]["s0"]["status"] = "pending"  # tonight: planned, nothing committed yet
    write_outputs(str(root / "2026-12-04"), {}, manifest, success=False)
    result = CliRunner().invoke(main, ["report", f"{root}/*", "--format", "json"])
    assert result.exit_code == 0, result.output
    assert f"warning: left out of the trend: {root}/2026-12-04: the manifest lists no committed shard" in result.output
    alone = CliRunner().invoke(main, ["report", str(root / "2026-12-04")])
    assert alone.exit_code == 1 and "no committed shard" in alone.output


def test_the_logical_date_is_jobrunner_date_else_the_clock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out" / "{date}"))
    monkeypatch.setenv("JOBRUNNER_DATE", "2026-11-30")
    spec = spec_from_dict(data)
    assert spec.logical_date == "2026-11-30" and spec.output.url.endswith("/out/2026-11-30")
    monkeypatch.delenv("JOBRUNNER_DATE")
    spec = spec_from_dict(data)
    assert spec.output.url.endswith("/out/" + spec.logical_date)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", spec.logical_date)


def test_latency_axes_name_the_unit_of_their_ticks(tmp_path: Path) -> None:
    report = load_report(write_job(str(tmp_path / "job")))
    p99 = report["latency_s"]["itl_mean_s"]["p99"]
    assert p99 < 1  # inter-token latencies of tens of ms: the axis is in milliseconds
    chart = latency_cdf_chart([report], "itl_mean_s")
    assert ">milliseconds (axis ends at the largest p99)<" in chart and ">seconds (axis" not in chart
    x_ticks = re.findall(r'<text class="tick" x="[\d.]+" y="256" text-anchor="middle">([^<]+)</text>', chart)
    assert x_ticks == [format(round(t * 1000, 9), ",.6g") for t in nice_ticks(p99)]
    e2e = latency_cdf_chart([report], "e2e_s")
    assert report["latency_s"]["e2e_s"]["p99"] > 1 and ">seconds (axis ends at the largest p99)<" in e2e
