"""A job's output URL opens in any Parquet reader (pyarrow, pyarrow.dataset, Ray Data), locally and on S3:
reports and bookkeeping live under `_` names; every part has one schema, an all-error part included."""

from __future__ import annotations

import fsspec
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from jobrunner.driver.job import run_job
from jobrunner.io.parts import output_schema, part_schema
from jobrunner.reports import write_job_report
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import fake_spec, new_bucket

pytestmark = pytest.mark.timeout(600)
KEPT = pa.schema([("topic", pa.string())])


def _write_input(url: str, storage_options: dict) -> list[str]:
    """16 rows in two row groups of 8; rows 8..15 have null prompts, so the second shard is all errors."""
    ids = [f"p{i:03d}" for i in range(16)]
    table = pa.table({"id": ids, "prompt": [f"question {i}" if i < 8 else None for i in range(16)],
                      "topic": [f"t{i % 3}" for i in range(16)]})
    with fsspec.open(url, "wb", **storage_options) as f:
        pq.write_table(table, f, row_group_size=8)
    return ids


# the fake engine's job: the contract columns, the reasoning columns (reasoning_parser auto), the kept column
JOB_SCHEMA = part_schema(KEPT, output_schema(reasoning=True))


def _run(input_url: str, output_url: str, storage_options: dict) -> list[str]:
    ids = _write_input(input_url, storage_options)
    # half the rows are errors on purpose (an all-error part): above the default error budget
    spec = spec_from_dict(fake_spec(input_url, output_url, storage_options, cluster={"num_workers": 1},
                                    output={"url": output_url, "storage_options": storage_options,
                                            "keep_columns": ["topic"], "max_error_rate": 1.0}))
    assert run_job(spec, show_progress=False).ok
    report = write_job_report(output_url, storage_options)
    assert "error" not in report, report
    assert all("/_report/report." in path for path in report["files"])
    return ids


def _check_parts_and_readers(parts: list[str], fs, root: str, filesystem, ids: list[str]) -> None:
    schemas = [pq.read_schema(fs.open(p, "rb")) for p in parts]
    assert len(schemas) == 2 and all(s.equals(JOB_SCHEMA) for s in schemas)
    table = pq.read_table(root, filesystem=filesystem)
    assert sorted(table.column("id").to_pylist()) == ids
    errors = table.filter(pa.compute.equal(table.column("finish_reason"), "error"))
    assert errors.num_rows == 8 and errors.column("generated_text").null_count == 8
    dataset = ds.dataset(root, filesystem=filesystem, format="parquet")
    assert dataset.count_rows() == 16 and dataset.schema.equals(JOB_SCHEMA)


def _ray_ids(path: str, filesystem=None) -> list[str]:
    import ray.data

    rows = ray.data.read_parquet(path, filesystem=filesystem).select_columns(["id"]).take_all()
    return sorted(r["id"] for r in rows)


def test_local_output_url_opens_in_pyarrow_and_ray_data(local_ray, tmp_path):
    out = tmp_path / "out"
    ids = _run(str(tmp_path / "in.parquet"), str(out), {})
    assert (out / "_report" / "report.html").exists() and not (out / "report.html").exists()
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("_")) == ["parts"]
    parts = sorted(str(p) for p in (out / "parts").glob("*.parquet"))
    _check_parts_and_readers(parts, fsspec.filesystem("file"), str(out), None, ids)
    assert _ray_ids(str(out)) == ids


def test_s3_output_url_opens_in_pyarrow_and_ray_data(local_ray, s3_server):
    from pyarrow import fs as pafs

    options = s3_server["storage_options"]
    bucket = new_bucket(s3_server)
    ids = _run(f"s3://{bucket}/in/data.parquet", f"s3://{bucket}/out", options)
    host = s3_server["endpoint_url"].split("://", 1)[1]
    s3 = pafs.S3FileSystem(access_key="testing", secret_key="testing", endpoint_override=host, scheme="http",
                           region="us-east-1")
    fs = fsspec.filesystem("s3", **options)
    fs.invalidate_cache()
    assert fs.exists(f"{bucket}/out/_report/report.html")
    parts = sorted(fs.glob(f"{bucket}/out/parts/*.parquet"))
    _check_parts_and_readers(parts, fs, f"{bucket}/out", s3, ids)
    assert _ray_ids(f"s3://{bucket}/out", filesystem=s3) == ids
