"""Fault tests on a local multi-node Ray cluster (several raylets on 127.0.0.1) with the fake engine.

One cluster for the module (a head with no CPUs and three 1-CPU nodes; each worker needs one CPU so workers
sit on different nodes and a spare node takes replacements). The fake engine sleeps per step so that kills
land mid-shard. Order matters: the node-removal test runs last.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import ray
import yaml

from jobrunner.driver.job import run_job
from jobrunner.io.manifest import read_manifest_with_records
from jobrunner.io.parts import read_output
from jobrunner.io.storage import Storage
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import REPO, fake_spec, read_manifest_file, write_prompts

pytestmark = pytest.mark.timeout(600)
SLOW = {"factory_options": {"step_delay_s": 0.05}}


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [c.add_node(num_cpus=1) for _ in range(3)]
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
    yield c, nodes
    ray.shutdown()
    c.shutdown()


def _spec(tmp_path, n_rows=64):
    ids = write_prompts(tmp_path / "in.parquet", n_rows)
    data = fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out"), engine=SLOW,
                     sampling={"max_tokens": 10}, cluster={"num_cpus_per_worker": 1, "retry_backoff_s": 0.2})
    return ids, data


def _wait_for(predicate, timeout=240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError("condition not reached")


def _committed(out) -> dict:
    """Committed shards as a reader sees them mid-run: the manifest plus the commit records."""
    try:
        manifest = read_manifest_with_records(Storage(str(out)))
    except (OSError, ValueError):
        return {}
    shards = (manifest or {}).get("shards") or {}
    return {s: e for s, e in shards.items() if e["status"] == "committed"}


def _worker_actor(worker_id: str):
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].startswith("jobrunner:fake-job:") and entry["name"].endswith(f":{worker_id}"):
            return ray.get_actor(entry["name"], namespace=entry["namespace"])
    return None


def _holds_unfinished_shard(actor, rows_per_shard: int = 8) -> bool:
    """Whether the worker ``actor`` (None: not started) runs a shard with rows still unfinished, by its own
    progress report."""
    if actor is None:
        return False
    try:
        shards = ray.get(actor.progress.remote(), timeout=10)["shards"]
    except (ray.exceptions.RayError, TimeoutError):
        return False
    return any(progress[0] < rows_per_shard for progress in shards.values())  # (rows, tokens, ...) per shard


def _run_in_thread(spec):
    box = {}
    thread = threading.Thread(target=lambda: box.update(result=run_job(spec, show_progress=False)))
    thread.start()
    return thread, box


def _assert_once(out, ids):
    got = read_output(str(out)).column("id").to_pylist()
    assert sorted(got) == ids and len(got) == len(set(got))


def test_killed_worker_actor_shards_are_retried(cluster, tmp_path):
    ids, data = _spec(tmp_path)
    thread, box = _run_in_thread(spec_from_dict(data))
    # killed mid-shard: once a shard is committed and w0 itself reports a shard with rows still to do (on a
    # loaded machine w0 may still be loading when w1 commits, or between two shards)
    _wait_for(lambda: _committed(tmp_path / "out") and _holds_unfinished_shard(_worker_actor("w0")))
    ray.kill(_worker_actor("w0"), no_restart=True)
    thread.join(timeout=240)
    assert box["result"].ok
    _assert_once(tmp_path / "out", ids)
    manifest = read_manifest_file(tmp_path / "out")
    retried = [e for e in manifest["shards"].values() if e["attempts"] == 2]
    assert retried
    # the retried shard was finished by a live worker (w1, or the replacement w2 if it started in time)
    assert all(e["worker_id"] != "w0" for e in retried)
    assert all(e["failures"] == 0 and e["infra_failures"] == 1 for e in retried)  # a killed actor is not charged


def test_killed_driver_then_resume_recomputes_nothing_committed(cluster, tmp_path):
    ids, data = _spec(tmp_path)
    # Generous: the lease must still hold when the second run tries below, however starved the machine is.
    data["output"]["lease_ttl_s"] = 120.0
    out = tmp_path / "out"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(data))
    cmd = [sys.executable, "-c", "from jobrunner.cli import main; main()", "run", str(tmp_path / "job.yaml"),
           "--address", cluster[0].address, "--no-progress", "--no-report"]
    driver = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: len(_committed(out)) >= 2, timeout=240)
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    before = _committed(out)
    assert len(before) < 8, "the driver finished before it was killed"
    mtimes = {s: (out / e["part"]).stat().st_mtime_ns for s, e in before.items()}
    # the same command at once: the killed driver ran on this host and its pid is gone, so its lease is
    # taken over without waiting for the ttl
    result = run_job(spec_from_dict(data), show_progress=False)
    assert result.ok
    _assert_once(out, ids)
    after = read_manifest_file(out)
    for shard_id, entry in before.items():
        assert after["shards"][shard_id]["worker_id"] == entry["worker_id"]
        assert (out / entry["part"]).stat().st_mtime_ns == mtimes[shard_id], f"{shard_id} recomputed"
    assert (out / "_SUCCESS").exists()
    assert json.loads((out / "_manifest.json").read_text())["run_count"] == 2


def _expire_lease(out) -> None:
    lease = json.loads((out / "_lease.json").read_text())
    (out / "_lease.json").write_text(json.dumps({**lease, "expires_at_s": time.time() - 1}))


def _worker_pid(worker_id: str) -> int:
    return ray.get(_worker_actor(worker_id).ready.remote())["stats"]["pid"]


def test_zombie_worker_never_publishes_a_second_part(cluster, tmp_path, monkeypatch):
    """SIGSTOP a worker mid-shard past the progress deadline: its shards are retried and committed elsewhere.
    The driver's kill of that worker is held back (as when the kill cannot reach it), so the zombie is still
    there to resume: SIGCONT it as soon as the driver gives it up, it finishes its stale attempts, and
    still every shard has one part, every id is there once, and no committed part is the zombie's."""
    ids, data = _spec(tmp_path)
    # A healthy worker finishes a step every ~0.05 s; 8 s is generous for one starved by a loaded machine.
    data["cluster"]["progress_timeout_s"] = 8.0
    out = tmp_path / "out"
    zombie: dict = {}
    real_kill = ray.kill

    def kill_all_but_the_zombie(actor, *args, **kwargs):
        if "id" in zombie and actor._actor_id == zombie["id"]:
            zombie["given_up"] = actor  # the driver is done with it; this reference keeps the actor alive
            return None
        return real_kill(actor, *args, **kwargs)

    monkeypatch.setattr(ray, "kill", kill_all_but_the_zombie)
    thread, box = _run_in_thread(spec_from_dict(data))
    _wait_for(lambda: _committed(out) and _holds_unfinished_shard(_worker_actor("w0")))
    actor = _worker_actor("w0")
    zombie["id"] = actor._actor_id
    pid = _worker_pid("w0")
    try:
        assert ray.get(actor.progress.remote())["shards"], "w0 held no shard when it was stopped"
        os.kill(pid, signal.SIGSTOP)
        _wait_for(lambda: "given_up" in zombie, timeout=240)  # declared dead; its shards go to other workers
        os.kill(pid, signal.SIGCONT)  # it must still be there: no ProcessLookupError to swallow
        # the zombie really runs again: it answers and finishes the attempts it held
        _wait_for(lambda: ray.get(actor.progress.remote(), timeout=30)["shards"] == {}, timeout=240)
        thread.join(timeout=240)
        assert not thread.is_alive(), "the job did not end"
        os.kill(pid, 0)  # alive to the end: whatever it handed back came from a live zombie
    finally:
        real_kill(actor, no_restart=True)
    assert box["result"].ok, box["result"].summary()
    _assert_once(out, ids)
    manifest = read_manifest_file(out)
    parts = sorted(p.name for p in (out / "parts").iterdir())
    assert parts == sorted(f"part-{s}.parquet" for s in manifest["shards"])
    retried = [e for e in manifest["shards"].values() if e["infra_failures"]]
    assert retried and all(e["worker_id"] != "w0" and e["failures"] == 0 for e in retried)


def test_hung_engine_is_replaced_and_its_row_isolated(cluster, tmp_path):
    ids = write_prompts(tmp_path / "in.parquet", 8, poison=5)
    data = fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out"),
                     engine={"factory_options": {"hang_on": "POISON"}}, output={"max_error_rate": 0.2},
                     cluster={"num_cpus_per_worker": 1, "progress_timeout_s": 5.0, "num_workers": 2})
    result = run_job(spec_from_dict(data), show_progress=False)
    rows = {r["id"]: r for r in read_output(str(tmp_path / "out")).to_pylist()}
    assert sorted(rows) == ids
    assert rows["p005"]["finish_reason"] == "error"
    assert "no token produced and no row finished for " in rows["p005"]["error"]
    assert "(engine step has not returned for " in rows["p005"]["error"]
    assert result.ok and read_manifest_file(tmp_path / "out")["totals"]["shards_failed"] == 0
    cost = read_manifest_file(tmp_path / "out")["runs"][-1]["isolation"]
    assert cost["model_loads"] >= 2 and cost["rows_isolated"] == 1


@pytest.mark.timeout(900)  # ~10 s alone; under `stress --cpu 2` each of its 3 worker starts took ~80 s
def test_restart_cap_makes_the_remaining_suspects_error_rows(cluster, tmp_path):
    """A row that hangs its worker, with one restart allowed per shard: the shard's rows become error rows
    naming the cap instead of costing a restart per bisection level."""
    ids = write_prompts(tmp_path / "in.parquet", 8, poison=5)
    data = fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out"),
                     engine={"factory_options": {"hang_on": "POISON"}}, output={"max_error_rate": 1.0},
                     cluster={"num_cpus_per_worker": 1, "progress_timeout_s": 3.0, "num_workers": 1,
                              "max_isolation_restarts_per_shard": 1})
    result = run_job(spec_from_dict(data), show_progress=False)
    rows = {r["id"]: r for r in read_output(str(tmp_path / "out")).to_pylist()}
    assert sorted(rows) == ids and all(r["finish_reason"] == "error" for r in rows.values())
    # the hang is seen as a hung step, or (on a loaded machine) as a worker not answering: a death either way
    assert re.match(r"engine crashed on one of rows 0-8, not isolated further "
                    r"\(cluster.max_isolation_restarts_per_shard=1 reached\): worker w\d+: ", rows["p000"]["error"])
    cost = read_manifest_file(tmp_path / "out")["runs"][-1]["isolation"]
    assert 1 <= cost["model_loads"] <= 2 and cost["rows_isolated"] == 8
    assert result.manifest["totals"]["shards_failed"] == 0


def test_start_deadline_names_the_missing_resources(cluster, tmp_path):
    _, data = _spec(tmp_path, n_rows=32)
    data["cluster"].update(num_gpus_per_worker=1, num_workers=4, worker_start_timeout_s=2.0)
    result = run_job(spec_from_dict(data), show_progress=False)  # no GPU anywhere: the deadline ends it
    assert not result.ok
    assert 'the cluster could not give {"CPU": 1.0, "GPU": 1.0} x 4' in result.error
    assert "worker_start_timeout_s=2s" in result.failure_message()
    assert '(cluster total {"CPU": 3.0}, available {"CPU": 3.0})' in result.error
    manifest = read_manifest_file(tmp_path / "out")
    assert {e["status"] for e in manifest["shards"].values()} == {"pending"}  # resumable later


def test_removed_node_mid_job(cluster, tmp_path):
    c, nodes = cluster
    ids, data = _spec(tmp_path)
    thread, box = _run_in_thread(spec_from_dict(data))
    _wait_for(lambda: _committed(tmp_path / "out") and _holds_unfinished_shard(_worker_actor("w1")))
    node_id = ray.get(_worker_actor("w1").ready.remote())["stats"]["node_id"]
    node = next(n for n in nodes if n.node_id == node_id)
    c.remove_node(node, allow_graceful=False)
    thread.join(timeout=240)
    assert box["result"].ok
    _assert_once(tmp_path / "out", ids)
    manifest = read_manifest_file(tmp_path / "out")
    # w1 was ready, then lost with its node; its replacement (w2) may still be loading when w0 finishes the
    # last shard on a loaded machine, so it is not required here
    assert {"w0", "w1"} <= set(manifest["workers"])
    lost = [e for e in manifest["shards"].values() if e["infra_failures"]]
    assert lost and all(e["failures"] == 0 for e in manifest["shards"].values())  # node loss is not charged
