"""write_job_report: what the driver calls when a job ends."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from jobrunner.reports import write_job_report


def test_writes_json_and_html_under_the_output(job_factory: Callable[..., str]) -> None:
    url = job_factory("job", error_every=10)
    report = write_job_report(url, None, worker_hour_usd=1.2)
    stored = json.loads((Path(url) / "_report" / "report.json").read_text())
    assert stored["rows"] == {k: v for k, v in report["rows"].items()}
    assert stored["cost"]["worker_hour_usd"] == 1.2 and stored["cost"]["price_source"] == "command line"
    assert (Path(url) / "_report" / "report.html").read_text().count("<svg") == 7
    assert len(report["files"]) == 2


def test_memory_filesystem() -> None:
    from report_outputs import write_job

    url = write_job("memory://reports-job/out", rows_per_shard=50, shards=1)
    report = write_job_report(url)
    assert report["rows"]["total"] == 50
    import fsspec

    assert fsspec.filesystem("memory").exists("/reports-job/out/_report/report.html")


def test_a_broken_part_is_reported_not_raised(job_factory: Callable[..., str]) -> None:
    url = job_factory("job")
    (Path(url) / "parts" / "part-s000.parquet").write_bytes(b"PAR1 not really parquet")
    result = write_job_report(url)
    assert set(result) == {"error"} and result["error"]
    assert not (Path(url) / "_report" / "report.json").exists()
