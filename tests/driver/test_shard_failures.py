"""Shards that fail for good: a row group that cannot be read (every attempt charged, up to
`cluster.max_shard_attempts`) and a publish that fails (the storage refuses the final key). Real Ray, fake engine."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from jobrunner.driver import job as job_module
from jobrunner.driver.job import run_job
from jobrunner.driver.plan import plan_job
from jobrunner.io.parts import read_output
from jobrunner.io.storage import StorageError
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import fake_spec, read_manifest_file, write_prompts

pytestmark = pytest.mark.timeout(600)


def _corrupt_row_group(path, index: int, column_index: int = 1) -> None:
    """Overwrite the first page header of row group `index` in one column (the prompts: the footer and the id
    column stay valid, so planning and its duplicate-id check still work; the worker's read fails)."""
    column = pq.ParquetFile(path).metadata.row_group(index).column(column_index)
    offset = column.dictionary_page_offset or column.data_page_offset
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * 16)


def test_unreadable_shard_fails_after_max_shard_attempts(local_ray, tmp_path):
    ids = write_prompts(tmp_path / "in.parquet", 24)  # 3 row groups of 8 = 3 shards of 8
    _corrupt_row_group(tmp_path / "in.parquet", 1)
    out = tmp_path / "out"
    spec = spec_from_dict(fake_spec(str(tmp_path / "in.parquet"), str(out),
                                    cluster={"num_workers": 1, "max_shard_attempts": 2, "retry_backoff_s": 0.05}))
    result = run_job(spec, show_progress=False)
    assert not result.ok and len(result.failed) == 1
    manifest = read_manifest_file(out)
    bad = [e for e in manifest["shards"].values() if e["row_start"] == 8]
    assert len(bad) == 1 and bad[0]["status"] == "failed" and bad[0]["attempts"] == 2  # then no third
    assert bad[0]["error"]
    assert {e["status"] for e in manifest["shards"].values() if e["row_start"] != 8} == {"committed"}
    assert sorted(read_output(str(out)).column("id").to_pylist()) == ids[:8] + ids[16:]
    assert "1 shard(s) failed" in result.failure_message()
    assert not (out / "_SUCCESS").exists()


def test_failed_publish_fails_the_shard_and_a_resume_commits_it(local_ray, tmp_path, monkeypatch):
    ids = write_prompts(tmp_path / "in.parquet", 16)
    out = tmp_path / "out"
    data = fake_spec(str(tmp_path / "in.parquet"), str(out), cluster={"num_workers": 1})
    refused = plan_job(spec_from_dict(data)).shards[1].shard_id
    real_commit = job_module.commit_parts

    def refusing_commit(storage, temp_keys, final_keys):
        if any(refused in k for k in final_keys):
            raise StorageError(f"commit {final_keys[0]}: failed after 4 attempts: injected outage")
        return real_commit(storage, temp_keys, final_keys)

    monkeypatch.setattr(job_module, "commit_parts", refusing_commit)
    result = run_job(spec_from_dict(data), show_progress=False)
    assert not result.ok and set(result.failed) == {refused}
    assert result.failed[refused].startswith("publishing failed: commit ") and "injected outage" in result.failed[
        refused]
    manifest = read_manifest_file(out)
    assert manifest["shards"][refused]["status"] == "failed"
    assert sorted(read_output(str(out)).column("id").to_pylist()) == ids[:8]  # only the other shard is visible
    assert not (out / "_SUCCESS").exists()

    monkeypatch.setattr(job_module, "commit_parts", real_commit)  # the storage is back: resume
    again = run_job(spec_from_dict(data), show_progress=False)
    assert again.ok and sorted(read_output(str(out)).column("id").to_pylist()) == ids
    assert (out / "_SUCCESS").exists()
