"""A lease held by a run inside a Ray job: taken over at once when that Ray job has ended (asked through the
cluster, a real submitted job on a real Ray head), never while it runs, and the countdown when the cluster
cannot say."""

from __future__ import annotations

import json
import sys
import time

from jobrunner.driver.ray_holder import RAY_KEY, holder_is_dead, ray_job_ended
from jobrunner.io.lease import acquire_lease, read_lease
from jobrunner.io.storage import Storage
from tests.cli.test_job_cli import ray_head  # noqa: F401 - the Ray head fixture (token auth, free ports)
from tests.driver.helpers import free_ports

HOLD = """
import sys, time
from jobrunner.driver.ray_holder import lease_extra
from jobrunner.io.lease import acquire_lease
from jobrunner.io.storage import Storage
acquire_lease(Storage(sys.argv[1]), "ray-held", 600.0, "held", extra=lease_extra())
print("holding", flush=True)
time.sleep(600)
"""


def _wait(predicate, what: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_lease_whose_ray_job_ended_is_taken_over_at_once(ray_head, tmp_path):  # noqa: F811
    from ray.job_submission import JobSubmissionClient

    from jobrunner.driver.submit import find_auth_token

    (tmp_path / "hold.py").write_text(HOLD)
    client = JobSubmissionClient(ray_head, headers={"Authorization": f"Bearer {find_auth_token()}"})
    job = client.submit_job(entrypoint=f"{sys.executable} {tmp_path / 'hold.py'} {tmp_path / 'out'}")
    storage = Storage(str(tmp_path / "out"))
    holder = _wait(lambda: read_lease(storage), "the Ray job to take the lease")
    assert holder[RAY_KEY]["submission_id"] == job and holder[RAY_KEY]["gcs_address"]
    assert "token" not in json.dumps(holder).lower()
    assert not ray_job_ended(holder)  # RUNNING: alive, so no takeover (the ttl is 600 s)
    client.stop_job(job)
    _wait(lambda: str(client.get_job_status(job)).endswith("STOPPED"), "the Ray job to stop")
    # the Ray answer alone (not the pid check, which would also see the process gone on this host)
    waits = []
    lease = acquire_lease(storage, "next", 600.0, "held", is_dead=ray_job_ended,
                          on_wait=lambda holder, left: waits.append(left))
    try:
        assert lease.generation == 2 and not waits  # taken at once: no countdown of the 600 s ttl
    finally:
        lease.release()


def test_no_answer_from_the_cluster_is_no_proof():
    [port] = free_ports(1)
    holder = {"run_id": "x", "host": "elsewhere", "pid": 1,
              RAY_KEY: {"submission_id": "raysubmit_gone", "dashboard": f"http://127.0.0.1:{port}"}}
    assert not ray_job_ended(holder, timeout_s=5) and not holder_is_dead(holder)
    assert not ray_job_ended({RAY_KEY: {"submission_id": "raysubmit_x"}})  # no address recorded
