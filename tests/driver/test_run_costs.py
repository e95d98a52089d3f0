"""Every run's cost counted: a run stopped by Ctrl-C (SIGINT) or kill -9 once shards are committing, then the
same job again. The manifest keeps both runs with their workers, its worker-seconds are the sum of the runs'
own records (`_runs/`), the report prices all of them, and its steady-state $ / M matches an uninterrupted
run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import ray
import yaml

from jobrunner.driver.job import run_job
from jobrunner.io.manifest import read_manifest_with_records
from jobrunner.io.parts import read_output
from jobrunner.io.run_records import KILLED, read_run_records
from jobrunner.io.storage import Storage
from jobrunner.reports import load_report
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import REPO, fake_spec, write_prompts

pytestmark = pytest.mark.timeout(600)
N_ROWS = 96  # 12 shards of 8 rows, one worker: 2 s a shard (the engine's steps: what the job's price is made of)


def _spec(tmp_path, out: str) -> tuple[list[str], dict]:
    ids = write_prompts(tmp_path / "in.parquet", N_ROWS)
    engine = {"max_num_seqs": 8, "factory_options": {"step_delay_s": 0.1, "load_delay_s": 1.0,
                                                     "count_sampled": True}}
    data = fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / out), engine=engine,
                     sampling={"max_tokens": 20}, cluster={"num_workers": 1, "num_cpus_per_worker": 1},
                     cost={"worker_hour_usd": 3.6})
    data["output"]["lease_ttl_s"] = 120.0
    return ids, data


def _committed(out) -> int:
    try:
        manifest = read_manifest_with_records(Storage(str(out)))
    except (OSError, ValueError):
        return 0
    return sum(e["status"] == "committed" for e in ((manifest or {}).get("shards") or {}).values())


def _stopped_run(tmp_path, data: dict, sig: int) -> None:
    """Run the job in its own driver process and send it `sig` once two shards are committed."""
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(data))
    cmd = [sys.executable, "-c", "from jobrunner.cli import main; main()", "run", str(tmp_path / "job.yaml"),
           "--address", ray.get_runtime_context().gcs_address, "--no-progress", "--no-report"]
    driver = subprocess.Popen(cmd, cwd=REPO, stdout=open(tmp_path / "driver.log", "wb"), stderr=subprocess.STDOUT)
    out = data["output"]["url"]
    try:
        deadline = time.monotonic() + 300
        while _committed(out) < 2 and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # a shard in flight: work this run pays for and the next one redoes
    finally:
        driver.send_signal(sig)
        driver.wait(timeout=120)
    assert _committed(out) < N_ROWS // 8, "the driver finished before it was stopped"


@pytest.fixture(scope="module")
def uninterrupted(local_ray, tmp_path_factory) -> dict:
    """The report of the same job run once, uninterrupted."""
    tmp_path = tmp_path_factory.mktemp("whole")
    _, data = _spec(tmp_path, "out")
    assert run_job(spec_from_dict(data), show_progress=False).ok
    return load_report(data["output"]["url"])


# kill -9 (no run record written by the driver itself) in the default suite; Ctrl-C, the gentler path, under heavy
# (its ~40 s kept the default suite under 15 minutes)
@pytest.mark.parametrize(("sig", "status"), [pytest.param(signal.SIGINT, "interrupted", marks=pytest.mark.heavy),
                                             (signal.SIGKILL, KILLED)])
def test_a_stopped_run_is_paid_for_in_the_resumed_job(local_ray, tmp_path, uninterrupted, sig, status):
    ids, data = _spec(tmp_path, "out")
    out = data["output"]["url"]
    _stopped_run(tmp_path, data, sig)
    first = read_run_records(Storage(out))
    assert len(first) == 1 and first[0]["run_index"] == 0 and first[0]["worker_seconds"] > 1.0
    assert first[0]["status"] == ("interrupted" if sig == signal.SIGINT else "running")  # kill -9: no last word
    if sig == signal.SIGINT:  # Ctrl-C also writes the manifest: its run and workers are there at once
        manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
        assert [r["status"] for r in manifest["runs"]] == ["interrupted"]
        assert "w0" in manifest["workers"]

    assert run_job(spec_from_dict(data), show_progress=False).ok
    got = read_output(out).column("id").to_pylist()
    assert sorted(got) == ids and len(got) == len(set(got))
    records = read_run_records(Storage(out))
    manifest = read_manifest_with_records(Storage(out))
    assert [(r["run_index"], r["status"]) for r in manifest["runs"]] == [(0, status), (1, "finished")]
    assert [r["status"] for r in records] == [first[0]["status"], "finished"]
    assert {"w0", "r1w0"} <= set(manifest["workers"])
    # the job's worker-seconds are both runs' own records, each run's the sum of its workers
    both = sum(r["worker_seconds"] for r in records)
    assert manifest["totals"]["worker_seconds"] == pytest.approx(both, abs=1.0)
    assert records[0]["worker_seconds"] >= first[0]["worker_seconds"]
    for record in records:
        assert record["worker_seconds"] == pytest.approx(
            sum(w["startup_s"] + w["alive_s"] for w in record["workers"].values()), abs=0.01)
    assert manifest["totals"]["num_runs"] == 2
    assert manifest["totals"]["lost_worker_seconds"] == pytest.approx(
        sum(r["lost_worker_seconds"] for r in manifest["runs"]), abs=0.01)

    report = load_report(out)
    assert report["time"]["worker_seconds"] == pytest.approx(both, abs=1.0)
    assert report["time"]["num_runs"] == 2
    assert report["cost"]["total_usd"] == pytest.approx(both * 3.6 / 3600, abs=0.001)
    assert any(note.startswith(f"run 0 ({status}") for note in report["cost"]["notes"])
    # two start-ups and redone work cost more per token than one run; once those are left out, the price per
    # token is the uninterrupted run's
    steady, whole = report["cost"]["steady_state"], uninterrupted["cost"]["steady_state"]
    assert report["cost"]["usd_per_m_total"] > uninterrupted["cost"]["usd_per_m_total"]
    assert steady["usd_per_m_total"] == pytest.approx(whole["usd_per_m_total"], rel=0.15), \
        (report["time"]["runs"], uninterrupted["time"]["runs"])
    assert os.path.exists(os.path.join(out, "_SUCCESS"))
