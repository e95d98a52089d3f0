"""`jobrunner jobs list | status | logs | stop`: the Ray jobs on a cluster, through Ray's Job Submission API."""

from __future__ import annotations

import json
import sys
import time

import click

from jobrunner.cli.echo import echo

_address = click.option("--address", required=True, envvar="RAY_ADDRESS", show_envvar=True,
                        help="Ray dashboard address, e.g. http://HEAD:8265.")
_token = click.option("--auth-token", default=None, envvar="RAY_AUTH_TOKEN",
                      help="Ray auth token (default: $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token).")
_json = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")


def _client(address: str, auth_token: str | None):
    from jobrunner.driver.submit import SubmitError, connect

    try:
        return connect(address, auth_token)
    except SubmitError as exc:
        raise click.ClickException(str(exc)) from None


def _call(client, what: str, job_id: str, fn: str, *args):
    from jobrunner.driver.submit import SubmitError, job_call

    try:
        return job_call(client, what, job_id, fn, *args)
    except SubmitError as exc:
        raise click.ClickException(str(exc)) from None


@click.group()
def jobs() -> None:
    """Ray jobs on a cluster (submitted with `jobrunner submit` or otherwise)."""


@jobs.command("list")
@_address
@_token
@_json
def list_jobs(address: str, auth_token: str | None, as_json: bool) -> None:
    """Every Ray job the cluster knows, newest first: id, status, jobrunner job name, start, duration."""
    from jobrunner.driver.submit import describe_job

    client = _client(address, auth_token)
    found = [describe_job(info) for info in client.list_jobs()]
    found.sort(key=lambda j: j["start_time"] or "", reverse=True)
    if as_json:
        echo(json.dumps(found))
        return
    echo(f"{'JOB ID':<28} {'STATUS':<10} {'JOB':<20} {'STARTED':<26} DURATION")
    for j in found:
        duration = "" if j["duration_s"] is None else f"{j['duration_s']:.0f} s"
        echo(f"{j['job_id'] or '?':<28} {j['status']:<10} {j['job_name'] or '-':<20} "
             f"{j['start_time'] or '-':<26} {duration}")


@jobs.command("status")
@click.argument("job_id")
@_address
@_token
@_json
def job_status(job_id: str, address: str, auth_token: str | None, as_json: bool) -> None:
    """The status of one Ray job; exit 1 if it FAILED."""
    from jobrunner.driver.submit import describe_job

    info = describe_job(_call(_client(address, auth_token), "cannot read", job_id, "get_job_info"))
    if as_json:
        echo(json.dumps(info))
    else:
        for key in ("job_id", "status", "job_name", "start_time", "end_time", "duration_s", "message"):
            echo(f"{key:<11} {'' if info[key] is None else info[key]}")
    if info["status"] == "FAILED":
        sys.exit(1)


@jobs.command("logs")
@click.argument("job_id")
@_address
@_token
@click.option("--follow", "-f", is_flag=True, help="Keep printing until the job ends; exit 1 unless it succeeded.")
def job_logs(job_id: str, address: str, auth_token: str | None, follow: bool) -> None:
    """The driver logs of one Ray job."""
    from jobrunner.driver.submit import SubmitError, follow_job

    client = _client(address, auth_token)
    if not follow:
        echo(_call(client, "cannot read the logs of", job_id, "get_job_logs"), nl=False)
        return
    _call(client, "cannot read", job_id, "get_job_status")  # an unknown id: a clear error, not a loop
    try:
        status = follow_job(client, job_id, sys.stdout)
    except SubmitError as exc:
        raise click.ClickException(str(exc)) from None
    echo(f"Ray job {job_id} ended: {status}", err=True)
    if status != "SUCCEEDED":
        sys.exit(1)


@jobs.command("stop")
@click.argument("job_id")
@_address
@_token
@click.option("--wait", is_flag=True, help="Wait until the job has stopped (at most 60 s).")
def stop_job(job_id: str, address: str, auth_token: str | None, wait: bool) -> None:
    """Ask Ray to stop one job (its driver gets SIGTERM; the output's lease lets a later run resume)."""
    from jobrunner.driver.submit import TERMINAL, describe_job

    client = _client(address, auth_token)
    stopped = _call(client, "cannot stop", job_id, "stop_job")
    status = describe_job(_call(client, "cannot read", job_id, "get_job_info"))["status"]
    deadline = time.monotonic() + 60
    while wait and status not in TERMINAL and time.monotonic() < deadline:
        time.sleep(1.0)
        status = describe_job(_call(client, "cannot read", job_id, "get_job_info"))["status"]
    echo(f"Ray job {job_id}: {'stop requested' if stopped else 'already ended'}; status {status}")


COMMANDS = [jobs]
