"""`jobrunner submit`: run a job spec as a Ray job through Ray's Job Submission API.

The spec travels in the job's runtime_env (env var JOBRUNNER_JOB_SPEC, JSON) and the entrypoint is
`jobrunner run env:JOBRUNNER_JOB_SPEC`, which joins the cluster through the RAY_ADDRESS that Ray sets for
the job. With token authentication (RAY_AUTH_MODE=token) every request carries `Authorization: Bearer
<token>`; the token comes from --auth-token / $RAY_AUTH_TOKEN, else the file $RAY_AUTH_TOKEN_PATH, else
~/.ray/auth_token (where `ray start` writes it). Passing the header ourselves works whether or not this
machine's Ray has token mode switched on.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, TextIO

from jobrunner.spec import JobSpec

SPEC_ENV = "JOBRUNNER_JOB_SPEC"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class SubmitError(RuntimeError):
    """Submission failed; the message names the address."""


def find_auth_token(explicit: str | None = None) -> str | None:
    """The Ray auth token from the argument, $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token."""
    if explicit:
        return explicit.strip()
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def build_submission(spec: JobSpec, working_dir: str | None = None) -> dict[str, Any]:
    """Entrypoint and runtime_env for a spec."""
    runtime_env: dict[str, Any] = {"env_vars": {SPEC_ENV: json.dumps(spec.model_dump(mode="json"))}}
    if working_dir:
        runtime_env["working_dir"] = working_dir
    return {"entrypoint": f"jobrunner run env:{SPEC_ENV}", "runtime_env": runtime_env,
            "metadata": {"jobrunner_job": spec.name}}


def submit_job(spec: JobSpec, address: str, auth_token: str | None = None,
               working_dir: str | None = None) -> tuple[Any, str]:
    """Submit; returns (client, Ray job id)."""
    from ray.job_submission import JobSubmissionClient

    token = find_auth_token(auth_token)
    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        client = JobSubmissionClient(address, headers=headers)
        job_id = client.submit_job(**build_submission(spec, working_dir))
    except Exception as exc:  # noqa: BLE001 - connection, HTTP and auth errors all end here
        raise SubmitError(f"cannot submit to {address}: {exc}") from None
    return client, job_id


def follow_job(client: Any, job_id: str, out: TextIO, poll_s: float = 1.0) -> str:
    """Print the job's logs as they grow until it ends; return its final status."""
    printed = 0
    while True:
        status = str(client.get_job_status(job_id)).rsplit(".", 1)[-1]
        logs = client.get_job_logs(job_id)
        out.write(logs[printed:])
        out.flush()
        printed = len(logs)
        if status in TERMINAL:
            return status
        time.sleep(poll_s)
