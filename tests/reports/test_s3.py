"""Reports read from and write to a real S3-compatible server (moto in server mode), through s3fs."""

from __future__ import annotations

import json

import fsspec
import pytest
from click.testing import CliRunner
from report_outputs import make_rows, write_job

from jobrunner.cli import main
from jobrunner.reports import load_report, write_job_report


@pytest.fixture(scope="module")
def s3_job(s3_server: dict) -> str:
    """One job output in its own bucket, written once for this module."""
    options = s3_server["storage_options"]
    fs = fsspec.filesystem("s3", **options)
    fs.mkdir("reports-test")
    fs.invalidate_cache()
    return write_job("s3://reports-test/jobs/example", rows_per_shard=300, shards=3, error_every=100,
                     storage_options=options)


# The rows write_job puts in the bucket (same seeds): the token totals a report of them must show.
ROWS = [make_rows(300, f"s{i:03d}", f"w{i}", seed=i, error_every=100) for i in range(3)]
INPUT_TOKENS = sum(sum(r["num_prompt_tokens"]) for r in ROWS)
OUTPUT_TOKENS = sum(sum(r["num_output_tokens"]) for r in ROWS)


@pytest.fixture(scope="module")
def local_report(tmp_path_factory) -> dict:
    """The same job written to local disk: the report read through S3 must equal it in every figure."""
    url = write_job(str(tmp_path_factory.mktemp("local") / "example"), rows_per_shard=300, shards=3,
                    error_every=100)
    return _without_url(load_report(url, worker_hour_usd=1.0))


def _without_url(report: dict) -> dict:
    return {**report, "run": {k: v for k, v in report["run"].items() if k != "url"}}


def test_report_from_s3(s3_job: str, s3_server: dict, local_report: dict) -> None:
    report = load_report(s3_job, s3_server["storage_options"], worker_hour_usd=1.0)
    assert report["rows"]["total"] == 900 and report["rows"]["errors"] == 9
    assert report["run"]["num_parts"] == 3 and report["run"]["complete"] is True
    assert report["run"]["url"] == s3_job
    assert (report["tokens"]["input"], report["tokens"]["output"]) == (INPUT_TOKENS, OUTPUT_TOKENS)
    cost = report["cost"]
    assert cost["usd_per_m_total"] == pytest.approx(cost["total_usd"] / (INPUT_TOKENS + OUTPUT_TOKENS) * 1e6)
    assert _without_url(report) == local_report  # every figure, chart point and warning


def test_cli_reads_s3(s3_job: str, s3_server: dict) -> None:
    options = json.dumps(s3_server["storage_options"])
    result = CliRunner().invoke(main, ["report", s3_job, "--storage-options", options, "--format", "json"])
    assert result.exit_code == 0, result.output
    tokens = json.loads(result.output)["tokens"]
    assert (tokens["input"], tokens["output"], tokens["total"]) == (
        INPUT_TOKENS, OUTPUT_TOKENS, INPUT_TOKENS + OUTPUT_TOKENS)


def test_write_job_report_to_s3(s3_job: str, s3_server: dict) -> None:
    options = s3_server["storage_options"]
    result = write_job_report(s3_job, options, worker_hour_usd=0.5)
    assert "error" not in result, result
    fs = fsspec.filesystem("s3", **options)
    fs.invalidate_cache()
    stored = json.loads(fs.cat_file("reports-test/jobs/example/_report/report.json"))
    assert stored["rows"]["total"] == 900 and stored["cost"]["worker_hour_usd"] == 0.5
    assert fs.cat_file("reports-test/jobs/example/_report/report.html").startswith(b"<!DOCTYPE html>")
    assert sorted(result["files"]) == ["s3://reports-test/jobs/example/_report/report.html",
                                       "s3://reports-test/jobs/example/_report/report.json"]


def test_only_metric_column_bytes_cross_the_network(s3_server: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A part of 20 MB of incompressible generated_text: the report fetches a small fraction of it."""
    import numpy as np
    import s3fs
    from report_outputs import make_manifest, make_rows, write_outputs

    options = s3_server["storage_options"]
    fsspec.filesystem("s3", **options).mkdir("reports-bytes")
    rows = make_rows(5000, "s0", "w0")
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    rng = np.random.default_rng(0)
    rows["generated_text"] = [rng.choice(letters, 4000).tobytes().decode() for _ in range(5000)]
    url = write_outputs("s3://reports-bytes/job", {"s0": rows}, make_manifest({"s0": rows}, 10.0), options,
                        row_group_rows=1000)
    fetched: list[int] = []
    original = s3fs.core.S3File._fetch_range

    def counting(self, start: int, end: int) -> bytes:
        fetched.append(end - start)
        return original(self, start, end)

    monkeypatch.setattr(s3fs.core.S3File, "_fetch_range", counting)
    assert load_report(url, options)["rows"]["total"] == 5000
    part_size = fsspec.filesystem("s3", **options).size("reports-bytes/job/parts/part-s0.parquet")
    print(f"fetched {sum(fetched):,} of {part_size:,} bytes in {len(fetched)} requests")
    assert part_size > 20_000_000 and sum(fetched) < part_size / 20
