"""The driver's side of the spending cap, on a fake engine that stops like the endpoint engine at its cap
(tests/endpoint/capped_engine.py): the run ends with the engine's reason, no shard is charged or failed, the
shards not committed are left pending with the reason, and the next run finishes without redoing a committed
part (the real endpoint and vLLM's server: test_endpoint_job.py)."""

from __future__ import annotations

import pytest

from jobrunner.driver.job import run_job
from jobrunner.io.parts import read_output
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import fake_spec, read_manifest_file, write_prompts

pytestmark = pytest.mark.timeout(300)


def _spec(tmp_path, max_rows: int):
    return spec_from_dict(fake_spec(
        str(tmp_path / "in.parquet"), str(tmp_path / "out"), input={"rows_per_shard": 4},
        engine={"max_num_seqs": 2, "factory": "tests.endpoint.capped_engine:make_engine",
                "factory_options": {"max_rows": max_rows}},
        cluster={"num_workers": 1, "num_cpus_per_worker": 0.5}))


def test_a_stopped_engine_ends_the_run_resumable_and_the_rerun_goes_on(local_ray, tmp_path):
    ids = write_prompts(tmp_path / "in.parquet", 16, row_group_size=4)
    first = run_job(_spec(tmp_path, 6), show_progress=False)
    assert not first.ok and first.error.startswith("cost.max_usd reached: this worker finished its 6 rows")
    assert first.error.endswith("the run stops, resumable: run it again to go on")
    parts = sorted((tmp_path / "out" / "parts").iterdir())
    assert len(parts) == 1  # the first shard; the second stopped two rows in
    mtime = parts[0].stat().st_mtime_ns
    manifest = read_manifest_file(tmp_path / "out")
    assert manifest["runs"][0]["stopped"] == first.error and manifest["runs"][0]["status"] == "failed"
    shards = sorted(manifest["shards"].values(), key=lambda e: e["status"])
    assert [e["status"] for e in shards] == ["committed", "pending", "pending", "pending"]
    assert [e["failures"] for e in shards] == [0, 0, 0, 0]  # nothing charged
    assert all(e["error"].startswith("not run: cost.max_usd reached") for e in shards[1:])
    second = run_job(_spec(tmp_path, 100), show_progress=False)
    assert second.ok, second.summary()
    assert parts[0].stat().st_mtime_ns == mtime
    assert sorted(r["id"] for r in read_output(str(tmp_path / "out")).to_pylist()) == ids
    assert read_manifest_file(tmp_path / "out")["run_count"] == 2
