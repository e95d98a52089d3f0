"""`jobrunner submit`: run a job spec as a Ray job through Ray's Job Submission API.

The spec travels, as written, in the job's runtime_env (env var JOBRUNNER_JOB_SPEC, JSON): secrets only
as `${env:NAME}` references, resolved on the head when the job loads the spec (a plain-text secret is
refused). The entrypoint runs `python -m jobrunner.cli run env:JOBRUNNER_JOB_SPEC` with a Python that has
jobrunner, found without relying on the head's PATH, and joins the cluster through the RAY_ADDRESS that Ray
sets for the job. With token authentication (RAY_AUTH_MODE=token) every request carries `Authorization: Bearer
<token>`; the token comes from --auth-token / $RAY_AUTH_TOKEN, else the file $RAY_AUTH_TOKEN_PATH, else
~/.ray/auth_token (where `ray start` writes it). Passing the header ourselves works whether or not this
machine's Ray has token mode switched on.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import string
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from jobrunner.redaction import redact_text
from jobrunner.spec import JobSpec, plain_text_secrets

SPEC_ENV = "JOBRUNNER_JOB_SPEC"
PYTHON_ENV = "JOBRUNNER_PYTHON"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
NO_AGENT = "No available agent to submit job"
AGENT_WAIT_S = 180.0  # a new head's job agent can take minutes to come up on a busy small machine
DROPPED_WAIT_S = 120.0  # how long a dashboard that drops or refuses to answer requests is retried
# A dashboard that is up but dropped this request (busy, restarting, a proxy in between): worth another try.
# "Connection refused" is not here: nothing listens at that address, most often a mistyped one.
DROPPED = ("Connection aborted", "RemoteDisconnected", "Connection reset", "Read timed out",
           "status code 502", "status code 503", "status code 504")


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


def build_submission(spec: JobSpec | dict[str, Any], working_dir: str | None = None,
                     python: str | None = None) -> dict[str, Any]:
    """Entrypoint and runtime_env for a spec (a JobSpec, or the spec as written, `${env:NAME}` kept).

    SubmitError when the spec holds a secret in plain text: Ray shows a job's runtime_env to anyone who can
    list jobs, so secrets must be `${env:NAME}` references resolved on the cluster.
    """
    data = spec.model_dump(mode="json") if isinstance(spec, JobSpec) else spec
    secrets = plain_text_secrets(data)
    if secrets:
        raise SubmitError(
            f"the spec holds secrets in plain text ({', '.join(secrets)}); submit never sends secrets to the "
            "cluster (Ray shows runtime_env to anyone who can list jobs). Write each as ${env:NAME} and set "
            "NAME in the environment of `ray start` on the head (docs/driver.md, Secrets)")
    env_vars = {SPEC_ENV: json.dumps(data)}
    if python:
        env_vars[PYTHON_ENV] = python
    runtime_env: dict[str, Any] = {"env_vars": env_vars}
    if working_dir:
        runtime_env["working_dir"] = working_dir
    return {"entrypoint": entrypoint(), "runtime_env": runtime_env,
            "metadata": {"jobrunner_job": str(data.get("name", ""))}}


def entrypoint(submitter_python: str | None = None) -> str:
    """A shell command that runs `jobrunner run env:JOBRUNNER_JOB_SPEC` with a Python that has jobrunner.

    The head's PATH is not trusted (a head started as `.venv/bin/ray start` has no `jobrunner` on it).
    Candidates, first that imports jobrunner and ray wins: $JOBRUNNER_PYTHON (`submit --python`), the Python
    that runs Ray on the head, this machine's interpreter (same machine or same image), then python3 / python
    on PATH. None: a message that says what the cluster needs, exit 127.
    """
    here = shlex.quote(submitter_python or sys.executable)
    candidates = f'"${{{PYTHON_ENV}:-}}" "{_VENV_OF_RAY}" "{_EXE_OF_RAY}" {here} python3 python'
    return (
        f'for py in {candidates}; do '
        f'if [ -n "$py" ] && "$py" -c "import jobrunner.cli, ray" >/dev/null 2>&1; then '
        f'echo "jobrunner submit: running with $py" >&2; '
        f'exec "$py" -m jobrunner.cli run env:{SPEC_ENV}; fi; done; '
        f'echo "{NOT_FOUND}" >&2; exit 127'
    )


# $PPID is the job supervisor, a Ray worker of the head. Its process title is rewritten by Ray ("ray::...") and
# its /proc exe resolves a venv's python to the base interpreter, so: the venv (or prefix) whose site-packages
# its ray/_raylet.so was loaded from, then its executable (right for non-venv installs).
_VENV_OF_RAY = ("$(sed -n 's#^.* \\(/[^ ]*\\)/lib/python[0-9.]*/site-packages/ray/_raylet[.]so$#\\1/bin/python#p' "
                "/proc/$PPID/maps 2>/dev/null | head -n 1)")
_EXE_OF_RAY = "$(readlink /proc/$PPID/exe 2>/dev/null)"


NOT_FOUND = (f"jobrunner submit: no Python on this Ray head can import jobrunner. Install jobrunner into the "
             f"Python that runs Ray on every node (pip install jobrunner, or pip install -e . in the image), "
             f"or pass --python /path/to/python (sent as {PYTHON_ENV}).")


def new_submission_id() -> str:
    """A fresh Ray submission id in Ray's own form (raysubmit_ and 16 letters or digits), made here so that a
    submission whose answer was lost can be sent again without starting the job twice."""
    alphabet = string.ascii_letters + string.digits
    return "raysubmit_" + "".join(secrets.choice(alphabet) for _ in range(16))


def submit_job(spec: JobSpec | dict[str, Any], address: str, auth_token: str | None = None,
               working_dir: str | None = None, python: str | None = None) -> tuple[Any, str]:
    """Submit; returns (client, Ray job id). SubmitError names the address (or the plain-text secrets).

    The submission id is chosen here, so a request the dashboard dropped is sent again safely: if the first
    try had reached the head, the retry is answered "already exists" and that job is the one returned — a job
    is never started twice. A head whose job agent is still starting is waited for (AGENT_WAIT_S); dropped
    connections and 502/503/504 answers are retried for DROPPED_WAIT_S.
    """
    from ray.job_submission import JobSubmissionClient

    submission = build_submission(spec, working_dir, python)
    submission_id = new_submission_id()
    token = find_auth_token(auth_token)
    headers = {"Authorization": f"Bearer {token}"} if token else None
    started = time.monotonic()
    tries = 0
    while True:
        tries += 1
        client = None
        try:
            client = JobSubmissionClient(address, headers=headers)
            return client, client.submit_job(submission_id=submission_id, **submission)
        except Exception as exc:  # noqa: BLE001 - connection, HTTP and auth errors all end here
            text = str(exc)
            if client is not None and tries > 1 and f"{submission_id} already exists" in text:
                return client, submission_id  # an earlier try reached the head; only its answer was lost
            waited_s = time.monotonic() - started
            # A head that has just started answers NO_AGENT until its job agent is up: wait for it.
            dropped = is_dropped(exc)
            if (NO_AGENT in text and waited_s < AGENT_WAIT_S) or (dropped and waited_s < DROPPED_WAIT_S):
                time.sleep(min(1.0 * tries, 5.0))
                continue
            if NO_AGENT in text:
                waited = f" (its job agent was not up after {AGENT_WAIT_S:.0f} s)"
            elif dropped:
                waited = f" (it dropped every request for {DROPPED_WAIT_S:.0f} s, {tries} tries)"
            else:
                waited = ""
            raise SubmitError(f"cannot submit to {address}{waited}: {redact_text(text)}") from None


def is_dropped(exc: BaseException | str) -> bool:
    """Whether an error says the dashboard was reached but dropped or refused to serve the request. Ray rewords
    a dropped version check as "Failed to connect to Ray at address": the cause it chained is read too."""
    seen: BaseException | str | None = exc
    for _ in range(4):  # the error, then what it was raised from or during
        if seen is None:
            return False
        if any(marker in str(seen) for marker in DROPPED):
            return True
        seen = None if isinstance(seen, str) else (seen.__cause__ or seen.__context__)
    return False


def follow_job(client: Any, job_id: str, out: TextIO, poll_s: float = 1.0,
               lost_after_s: float | None = None) -> str:
    """Print the job's logs as they grow until it ends; return its final status (SUCCEEDED, FAILED, STOPPED).

    A dashboard that stops answering for a while (busy, restarting) is polled again; after `lost_after_s`
    (default DROPPED_WAIT_S) without an answer a SubmitError says so and that the job may still be running.
    """
    lost_after_s = DROPPED_WAIT_S if lost_after_s is None else lost_after_s
    printed = 0
    silent_since: float | None = None
    while True:
        try:
            status = _status_name(client.get_job_status(job_id))
            logs = client.get_job_logs(job_id)
        except Exception as exc:  # noqa: BLE001 - connection and HTTP errors; the job runs on regardless
            now = time.monotonic()
            silent_since = silent_since or now
            if now - silent_since >= lost_after_s:
                address = getattr(client, "_address", "the Ray dashboard")
                raise SubmitError(
                    f"lost contact with {address} while following Ray job {job_id} (no answer for "
                    f"{lost_after_s:.0f} s): {redact_text(str(exc))}. The job may still be running: "
                    f"jobrunner jobs status {job_id} --address {address}") from None
            time.sleep(poll_s)
            continue
        silent_since = None
        out.write(logs[printed:])
        out.flush()
        printed = len(logs)
        if status in TERMINAL:
            return status
        time.sleep(poll_s)


def connect(address: str, auth_token: str | None = None) -> Any:
    """A JobSubmissionClient for the dashboard at `address` (token auth as for submit); SubmitError names it."""
    from ray.job_submission import JobSubmissionClient

    token = find_auth_token(auth_token)
    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        return JobSubmissionClient(address, headers=headers)
    except Exception as exc:  # noqa: BLE001 - connection, HTTP and auth errors all end here
        raise SubmitError(f"cannot reach the Ray dashboard at {address}: {redact_text(str(exc))}") from None


def describe_job(info: Any) -> dict[str, Any]:
    """A Ray JobDetails / JobInfo as a plain dict: id, status, jobrunner job name, times, message."""
    metadata = getattr(info, "metadata", None) or {}
    start, end = getattr(info, "start_time", None), getattr(info, "end_time", None)
    return {"job_id": getattr(info, "submission_id", None) or getattr(info, "job_id", None),
            "status": _status_name(getattr(info, "status", "")), "job_name": metadata.get("jobrunner_job"),
            "start_time": _iso_ms(start), "end_time": _iso_ms(end),
            "duration_s": None if not start else round(((end or time.time() * 1000) - start) / 1000, 1),
            "message": redact_text(str(getattr(info, "message", "") or "")),
            "entrypoint": str(getattr(info, "entrypoint", "") or "")}


def job_call(client: Any, what: str, job_id: str, fn: str, *args: Any) -> Any:
    """client.<fn>(job_id, ...) with Ray's errors turned into a SubmitError naming the job."""
    try:
        return getattr(client, fn)(job_id, *args)
    except Exception as exc:  # noqa: BLE001 - Ray raises RuntimeError for an unknown id, HTTP errors, ...
        raise SubmitError(f"{what} Ray job {job_id}: {redact_text(str(exc))}") from None


def _status_name(status: Any) -> str:
    return str(status).rsplit(".", 1)[-1]


def _iso_ms(epoch_ms: Any) -> str | None:
    if not isinstance(epoch_ms, (int, float)) or not epoch_ms:
        return None
    from datetime import datetime, timezone

    return datetime.fromtimestamp(epoch_ms / 1000, timezone.utc).isoformat(timespec="seconds")
