"""Bad input: a clear message, no division by zero, no NaN/inf shown anywhere."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from report_outputs import make_manifest, make_rows, write_job, write_outputs

from jobrunner.reports import ReportInputError, Slo, load_report, write_job_report
from jobrunner.reports.html import render_html
from jobrunner.reports.text import render_json, render_markdown, render_text

NOT_A_NUMBER = re.compile(r"\b(nan|NaN|inf|Infinity)\b")


def _all_renderings(report: dict) -> list[str]:
    return [render(reports) for render in (render_text, render_markdown, render_json, render_html)
            for reports in ([report], [report, report])]


def _errors_only(tmp_path: Path, **manifest_kw) -> str:
    rows = make_rows(30, "s0", "w0", error_every=1)
    rows["error"] = ["worker crashed"] * 30
    rows["finish_reason"] = ["error"] * 30
    rows["num_output_tokens"] = [0] * 30
    rows["num_cached_tokens"] = [0] * 30
    for name in ("ttft_s", "itl_mean_s", "e2e_s", "queue_s"):
        rows[name] = [None] * 30
    manifest = make_manifest({"s0": rows}, 3.0, **manifest_kw)
    return write_outputs(str(tmp_path / "errs"), {"s0": rows}, manifest)


def test_path_with_no_outputs(tmp_path: Path) -> None:
    with pytest.raises(ReportInputError, match="no jobrunner outputs here"):
        load_report(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportInputError, match="no _manifest.json and no parts"):
        load_report(str(tmp_path / "empty"))


def test_manifest_from_another_version(tmp_path: Path) -> None:
    url = write_job(str(tmp_path / "job"), rows_per_shard=10, shards=1)
    manifest = json.loads((tmp_path / "job" / "_manifest.json").read_text())
    manifest.update(format_version=99, jobrunner_version="9.0.0")
    (tmp_path / "job" / "_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ReportInputError, match=r"format_version 99 \(written by jobrunner 9.0.0\).*reads "
                                               r"format_version 1, 2"):
        load_report(url)


def test_manifest_not_json(tmp_path: Path) -> None:
    url = write_job(str(tmp_path / "job"), rows_per_shard=10, shards=1)
    (tmp_path / "job" / "_manifest.json").write_text("{not json")
    with pytest.raises(ReportInputError, match="not valid JSON"):
        load_report(url)


def test_manifest_with_no_committed_shard(tmp_path: Path) -> None:
    rows = make_rows(5, "s0", "w0")
    manifest = make_manifest({"s0": rows}, 1.0)
    manifest["shards"]["s0"]["status"] = "pending"
    url = write_outputs(str(tmp_path / "job"), {}, manifest, success=False)
    with pytest.raises(ReportInputError, match="no committed shard"):
        load_report(url)


def test_part_that_is_not_a_jobrunner_output(tmp_path: Path) -> None:
    (tmp_path / "job" / "parts").mkdir(parents=True)
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "job" / "parts" / "part-0.parquet")
    with pytest.raises(ReportInputError, match="missing columns: num_prompt_tokens"):
        load_report(str(tmp_path / "job"))


def test_rows_with_errors_only(tmp_path: Path) -> None:
    report = load_report(_errors_only(tmp_path, worker_hour_usd=1.0), slo=Slo(ttft_s=1.0))
    assert report["rows"]["errors"] == 30 and report["rows"]["errors_by_kind"] == {"worker crashed": 30}
    assert report["latency_s"]["ttft_s"]["p50"] is None
    assert report["cost"]["usd_per_m_output"] is None
    assert report["goodput"]["row_share"] == 0.0 and report["goodput"]["output_token_share"] is None
    assert any("every row failed" in w for w in report["warnings"])
    for text in _all_renderings(report):
        assert not NOT_A_NUMBER.search(text)
    assert "no latency recorded" in render_html([report])


def test_zero_output_tokens(tmp_path: Path) -> None:
    rows = make_rows(20, "s0", "w0")
    rows["num_output_tokens"] = [0] * 20
    url = write_outputs(str(tmp_path / "job"), {"s0": rows}, make_manifest({"s0": rows}, 2.0))
    report = load_report(url)
    assert report["cost"]["usd_per_m_output"] is None
    assert report["cost"]["usd_per_m_input"] is not None
    assert "zero output tokens" in render_text([report])
    for text in _all_renderings(report):
        assert not NOT_A_NUMBER.search(text)


def test_no_price_means_no_cost_not_zero(tmp_path: Path) -> None:
    url = write_job(str(tmp_path / "job"), rows_per_shard=20, shards=1, worker_hour_usd=0.0)
    report = load_report(url)
    assert report["cost"]["total_usd"] is None and report["cost"]["price_source"] == "none"
    assert "$0" not in render_text([report])
    assert "no cost: give --worker-hour-usd" in render_html([report])


def test_outputs_without_a_manifest(tmp_path: Path) -> None:
    rows = make_rows(20, "s0", "w0")
    report = load_report(write_outputs(str(tmp_path / "job"), {"s0": rows}, None, success=False))
    assert report["rows"]["total"] == 20
    assert report["time"]["wall_s"] == pytest.approx(max(rows["finish_time_s"]))
    assert report["cost"]["total_usd"] is None
    assert any("no _manifest.json" in w for w in report["warnings"])
    assert any("no _SUCCESS" in w for w in report["warnings"])


def test_odd_manifest_fields_do_not_crash(tmp_path: Path) -> None:
    rows = make_rows(10, "s0", "w0")
    manifest = make_manifest({"s0": rows}, 2.0)
    manifest.update(wall_s="soon", workers={"w0": "gone"}, model={"dtype": float("nan")}, totals=[],
                    spec=None, cost={"worker_hour_usd": float("nan")}, job_name=float("inf"))
    report = load_report(write_outputs(str(tmp_path / "job"), {"s0": rows}, manifest))
    assert report["time"]["worker_seconds"] is None and report["cost"]["total_usd"] is None
    for text in _all_renderings(report):
        assert not NOT_A_NUMBER.search(text)


def test_write_job_report_never_raises(tmp_path: Path) -> None:
    result = write_job_report(str(tmp_path / "nothing"))
    assert "no jobrunner outputs" in result["error"]
    assert not (tmp_path / "nothing" / "_report" / "report.json").exists()
