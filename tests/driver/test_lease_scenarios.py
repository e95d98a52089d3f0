"""The lease guarantees end to end: real `jobrunner run` processes on one local Ray, the fake engine slowed per step
so that signals land mid-job (once scripts/guarantees/lease_scenarios.py, now tests).

* a driver stopped (SIGSTOP) past its lease ttl while another run takes the output over and finishes: resumed,
  it publishes nothing (no file under the output changes) and exits non-zero;
* a live holder whose clock is 3 h behind is not taken over; a crashed holder on another host whose clock is 3 h
  ahead is taken over after its ttl, not after 3 h;
* the input file rewritten while the job runs: the next shards fail naming the file, a rerun refuses (the input
  changed under committed shards), with the original file back the rerun finishes.

Already tests elsewhere (the script's other scenarios): racing acquisitions (tests/io/test_lease.py), kill -9 then
the same command at once (tests/driver/test_faults.py), a run that committed nothing replaced
(tests/driver/test_rerun_output.py), a lease whose Ray job ended (tests/driver/test_ray_holder.py).
Nothing here asserts on elapsed time; each step waits for the state it expects, with generous outer timeouts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests.driver.helpers import REPO, read_manifest_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
TTL_S = 5.0  # the smallest lease_ttl_s a spec accepts
NUM_SHARDS = 12  # 96 rows, 8 per shard
SKEW = "import time as _t; _real = _t.time; _t.time = lambda: _real() + {offset}"
OTHER_HOST = "import socket as _s; _s.gethostname = lambda: 'far-host'"


@pytest.fixture(scope="module")
def address():
    """A local Ray head the driver processes join (4 CPUs: two jobs' workers at once)."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
    yield cluster.address
    cluster.shutdown()


def _write_input(path: Path, num_rows: int) -> list[str]:
    ids = [f"r{i:04d}" for i in range(num_rows)]
    pq.write_table(pa.table({"id": ids, "prompt": [f"question {i} about things" for i in range(num_rows)]}),
                   path, row_group_size=8)
    return ids


def _job(work: Path, step_delay_s: float = 0.1, hold_file: Path | None = None) -> tuple[Path, list[str]]:
    """The job's spec file and its input's ids; with ``hold_file``, each worker's engine waits after its first
    finished row until that file exists (tests/driver/fake_engine.py)."""
    work.mkdir(parents=True, exist_ok=True)
    ids = _write_input(work / "in.parquet", 8 * NUM_SHARDS)
    spec = {"name": "lease-scenario",
            "input": {"url": str(work / "in.parquet"), "prompt_column": "prompt", "id_column": "id",
                      "rows_per_shard": 8},
            "sampling": {"max_tokens": 4},
            "engine": {"max_num_seqs": 4, "factory": "tests.driver.fake_engine:make_engine",
                       "factory_options": {"step_delay_s": step_delay_s,
                                           **({"hold_file": str(hold_file)} if hold_file else {})}},
            "cluster": {"num_workers": 2, "num_cpus_per_worker": 0.5, "retry_backoff_s": 0.1},
            "output": {"url": str(work / "out"), "lease_ttl_s": TTL_S}}
    job = work / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    return job, ids


def _driver(job: Path, address: str, log: Path, prelude: str = "") -> subprocess.Popen:
    """`jobrunner run JOB` in its own process; `prelude` runs first (to skew its clock or its host name)."""
    code = f"{prelude}\nfrom jobrunner.cli import main; main()"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-c", code, "run", str(job), "--address", address, "--no-progress",
                             "--no-report"], cwd=REPO, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def _committed(out: Path) -> set[str]:
    """Committed shard ids, read the way a run reads them (commit records folded in)."""
    try:
        manifest = read_manifest_file(out)  # None before the first manifest is written
    except (OSError, ValueError):
        return set()
    shards = (manifest or {}).get("shards") or {}
    return {shard_id for shard_id, entry in shards.items() if entry["status"] == "committed"}


def _generation(out: Path) -> int | None:
    try:
        return json.loads((out / "_lease.json").read_text()).get("generation")
    except (OSError, ValueError):
        return None


def _wait_for(what: Callable[[], bool], timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def _snapshot(out: Path) -> dict[str, tuple[int, int]]:
    """Every file under the output but the lease's own: (mtime_ns, size)."""
    return {str(p.relative_to(out)): (p.stat().st_mtime_ns, p.stat().st_size) for p in out.rglob("*")
            if p.is_file() and not p.name.startswith("_lease.json")}


def _ids(out: Path) -> list[str]:
    return sorted(i for p in (out / "parts").glob("part-*.parquet") for i in pq.read_table(p).column("id").to_pylist())


def _manifest_parts(out: Path) -> set[str]:
    shards = read_manifest_file(out)["shards"].values()
    return {p for e in shards if e["status"] == "committed" for p in e.get("parts") or [e["part"]]}


def _log(path: Path) -> str:
    return path.read_text(errors="replace")


def test_a_stopped_driver_that_lost_its_lease_publishes_nothing(address, tmp_path):
    job, ids = _job(tmp_path)
    out = tmp_path / "out"
    a = _driver(job, address, tmp_path / "a.log")
    try:
        _wait_for(lambda: len(_committed(out)) >= 1)
        os.kill(a.pid, signal.SIGSTOP)
        stopped_with = _committed(out)
        assert len(stopped_with) < NUM_SHARDS, "driver A finished before it was stopped"
        a_generation = _generation(out)
        b = _driver(job, address, tmp_path / "b.log")
        _wait_for(lambda: _generation(out) != a_generation)  # B took the lease over once A's ttl ran out
        assert b.wait(timeout=400) == 0, _log(tmp_path / "b.log")
        after_b = _snapshot(out)
    finally:
        os.kill(a.pid, signal.SIGCONT)
    a_rc = a.wait(timeout=120)
    assert a_rc != 0, _log(tmp_path / "a.log")
    changed = sorted(k for k in set(_snapshot(out)) | set(after_b) if _snapshot(out).get(k) != after_b.get(k))
    assert changed == []  # A, resumed, wrote and deleted nothing under the output
    # A says why it stopped: its lease expired on its own clock, or was found taken over (whichever it met first)
    a_log = _log(tmp_path / "a.log")
    assert "out/_lease.json: this run's lease " in a_log and "; stopping" in a_log
    parts = {str(p.relative_to(out)) for p in (out / "parts").glob("part-*")}
    assert parts == _manifest_parts(out) and len(_committed(out)) == NUM_SHARDS
    assert _ids(out) == sorted(ids)  # every id once
    assert _generation(out) == a_generation + 1


def test_a_live_holder_whose_clock_is_behind_is_not_taken_over(address, tmp_path):
    go = tmp_path / "go"  # A holds after its first rows until B has watched it and refused, however fast
    job, ids = _job(tmp_path, step_delay_s=0.05, hold_file=go)  # the machine (A once ended before B watched)
    out = tmp_path / "out"
    a = _driver(job, address, tmp_path / "a.log", SKEW.format(offset=-3 * 3600))
    _wait_for(lambda: _generation(out) is not None)
    b = _driver(job, address, tmp_path / "b.log")
    b_rc = b.wait(timeout=300)
    go.touch()
    a_rc = a.wait(timeout=400)
    assert b_rc != 0 and "which is alive" in _log(tmp_path / "b.log")
    assert a_rc == 0, _log(tmp_path / "a.log")
    assert _ids(out) == sorted(ids)


def test_a_crashed_holder_whose_clock_is_ahead_is_taken_over_after_its_ttl(address, tmp_path):
    job, ids = _job(tmp_path)
    out = tmp_path / "out"
    # on "another host", so its pid cannot be checked here: only the ttl (measured here, not by its clock) counts
    c = _driver(job, address, tmp_path / "c.log", SKEW.format(offset=3 * 3600) + "\n" + OTHER_HOST)
    _wait_for(lambda: len(_committed(out)) >= 1)
    c.send_signal(signal.SIGKILL)
    c.wait()
    generation = _generation(out)
    d = _driver(job, address, tmp_path / "d.log")
    # taken over within minutes (its expiry reads 3 h in the future); a wait of 3 h would time out here
    _wait_for(lambda: _generation(out) != generation, timeout_s=240)
    assert d.wait(timeout=400) == 0, _log(tmp_path / "d.log")
    assert _ids(out) == sorted(ids)


def test_an_input_rewritten_mid_job_fails_the_run_and_blocks_a_rerun_until_it_is_back(address, tmp_path):
    job, ids = _job(tmp_path, step_delay_s=0.2)
    out, original = tmp_path / "out", (tmp_path / "in.parquet").read_bytes()
    a = _driver(job, address, tmp_path / "a.log")
    _wait_for(lambda: len(_committed(out)) >= 1)
    _write_input(tmp_path / "in.parquet", 8 * NUM_SHARDS + 8)  # rewritten: 8 more rows
    assert a.wait(timeout=400) != 0
    assert f"input file file://{tmp_path}/in.parquet changed after the job was planned" in _log(tmp_path / "a.log")
    b = _driver(job, address, tmp_path / "b.log")
    assert b.wait(timeout=300) != 0
    b_log = _log(tmp_path / "b.log")
    assert "the input changed since the earlier run" in b_log and "in.parquet changed (" in b_log
    (tmp_path / "in.parquet").write_bytes(original)  # put back
    c = _driver(job, address, tmp_path / "c.log")
    assert c.wait(timeout=400) == 0, _log(tmp_path / "c.log")
    assert _ids(out) == sorted(ids)
