"""A lease holder that ran as a Ray job: what its lease records, and whether that Ray job has ended.

A run inside a submitted Ray job (`jobrunner submit`) records its submission id and the cluster's address in
its lease (`ray` in `_lease.json`); a driver that joined a cluster records its Ray job id and the dashboard
address once it is connected. A later run that finds such a lease asks that cluster (Ray's Job Submission
API, with the same token search as `submit`, a few seconds at most) what became of the job: SUCCEEDED, FAILED
or STOPPED means the holder's process is gone (Ray sets STOPPED only after the job's processes were killed),
so the lease is taken over at once. Anything else (running, pending, no answer, no such job, no address) is
not proof: the run falls back to watching the lease for its ttl (io/lease.py). Addresses are redacted; no
token is ever written.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from jobrunner.io.lease import Lease, holder_is_dead_here
from jobrunner.redaction import redact_text, redacting_logger

log = redacting_logger(__name__)
RAY_KEY = "ray"  # the lease's field for the Ray job that holds it
QUERY_TIMEOUT_S = 5.0  # most time spent asking a cluster about a holder's job
ENDED = ("SUCCEEDED", "FAILED", "STOPPED")
T = TypeVar("T")


def submitted_job() -> dict[str, str]:
    """The Ray job this process runs in, when it is a submitted job's entrypoint: its submission id and the
    cluster's (GCS) address, from what Ray's job supervisor sets; {} otherwise."""
    try:
        config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    except ValueError:
        return {}
    submission_id = ((config or {}).get("metadata") or {}).get("job_submission_id")
    if not submission_id:
        return {}
    out = {"submission_id": str(submission_id)}
    if os.environ.get("RAY_ADDRESS"):
        out["gcs_address"] = redact_text(os.environ["RAY_ADDRESS"])
    return out


def lease_extra() -> dict[str, Any]:
    """What a new lease records about this run's Ray job (nothing outside one)."""
    job = submitted_job()
    return {RAY_KEY: job} if job else {}


def note_ray_driver(lease: Lease, local: bool) -> None:
    """Add this driver's Ray job id and the dashboard address to its lease once Ray is connected (not for a
    local Ray started for this job alone: it ends with the process, and the pid check covers that)."""
    if local:
        return
    import ray

    try:
        job_id = ray.get_runtime_context().get_job_id()
        dashboard = ray._private.worker.global_worker.node.address_info.get("webui_url") or ""
    except Exception as exc:  # noqa: BLE001 - best effort: without it a rerun waits for the ttl
        log.debug("no Ray job identity for the lease: %s", exc)
        return
    info = dict(lease.extra.get(RAY_KEY) or {}, job_id=job_id)
    if dashboard:
        info["dashboard"] = redact_text(dashboard if "://" in dashboard else f"http://{dashboard}")
    lease.extra[RAY_KEY] = info
    lease.renew()  # written now, not at the next heartbeat


def holder_is_dead(holder: dict[str, Any]) -> bool:
    """Provably dead: on this host with its pid gone (io/lease.py), or its Ray job has ended."""
    return holder_is_dead_here(holder) or ray_job_ended(holder)


def ray_job_ended(holder: dict[str, Any], timeout_s: float = QUERY_TIMEOUT_S) -> bool:
    """True only when the cluster named in the lease says the holder's Ray job ended."""
    info = holder.get(RAY_KEY)
    if not isinstance(info, dict):
        return False
    job = info.get("submission_id") or info.get("job_id")
    if not job:
        return False
    status = _with_timeout(lambda: _job_status(info, str(job)), timeout_s)
    if status in ENDED:
        log.warning("%s", redact_text(f"the lease holder's Ray job {job} has ended ({status})"))
        return True
    return False


def _job_status(info: dict[str, Any], job: str) -> str | None:
    from ray.job_submission import JobSubmissionClient

    from jobrunner.driver.submit import find_auth_token

    address = info.get("dashboard") or _dashboard_of(info.get("gcs_address"))
    if not address:
        return None
    token = find_auth_token()
    client = JobSubmissionClient(address, headers={"Authorization": f"Bearer {token}"} if token else None)
    return str(client.get_job_info(job).status).rsplit(".", 1)[-1]


def _dashboard_of(gcs_address: str | None) -> str | None:
    """The dashboard URL a cluster publishes in its GCS, from the cluster's address."""
    if not gcs_address:
        return None
    from ray._raylet import GcsClient

    url = GcsClient(address=gcs_address).internal_kv_get(b"dashboard", namespace=b"dashboard",
                                                         timeout=QUERY_TIMEOUT_S)
    return f"http://{url.decode()}" if url else None


def _with_timeout(fn: Callable[[], T], timeout_s: float) -> T | None:
    """fn() on a daemon thread; None when it raises or has not answered within timeout_s."""
    box: list[Any] = []

    def call() -> None:
        try:
            box.append(fn())
        except Exception as exc:  # noqa: BLE001 - unreachable cluster, unknown job, auth: no proof
            log.debug("Ray job status unknown: %s", redact_text(str(exc)))

    thread = threading.Thread(target=call, name="ray-job-status", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return box[0] if box else None
