"""`jobrunner run | validate | submit`: thin commands over jobrunner.driver."""

from __future__ import annotations

import sys
import time

import click

from jobrunner.redaction import redact_text
from jobrunner.spec import SpecError, load_spec, load_spec_data

_set_option = click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
                           help="Override a spec field, e.g. --set sampling.max_tokens=32 (repeatable).")


def _load(path: str, overrides: tuple[str, ...]):
    try:
        return load_spec(path, overrides)
    except SpecError as exc:
        raise click.ClickException(str(exc)) from None


@click.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@click.option("--check-ids", is_flag=True, help="Kept for old scripts: ids are always checked now.")
def validate(job_file: str, overrides: tuple[str, ...], check_ids: bool) -> None:
    """Check JOB_FILE, its input (files, rows, shards, columns) and output, without starting any worker."""
    from jobrunner.driver.manifest import ResumeError
    from jobrunner.driver.plan import OutputError, describe_output, plan_job, required_columns
    from jobrunner.io.reader import InputError
    from jobrunner.io.storage import StorageError

    spec = _load(job_file, overrides)
    started = time.perf_counter()
    try:
        plan = plan_job(spec)  # duplicate ids included: every run checks them
        plan_s = time.perf_counter() - started
        output_state = describe_output(spec, plan)
    except (InputError, OutputError, ResumeError, StorageError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"job {spec.name!r}: spec OK")
    num_bytes = sum(f.num_bytes for f in plan.files)
    click.echo(f"input {redact_text(spec.input.url)}: {len(plan.files)} file(s), {plan.num_rows} rows, "
               f"{len(plan.shards)} shard(s) of about {spec.rows_per_shard} rows ({num_bytes} bytes, "
               f"planned in {plan_s:.2f}s)")
    for f in plan.files:
        click.echo(f"  {f.url}: {f.num_rows} rows, {len(f.row_group_num_rows)} row group(s)")
    keep = spec.output.keep_columns
    columns = list(required_columns(spec).values()) + (["* (every input column)"] if keep == "*" else keep)
    click.echo(f"required columns present: {', '.join(columns)}")
    click.echo(f"output {redact_text(spec.output.url)} (mode {spec.output.mode}): {output_state}")


@click.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@click.option("--address", default=None, help="Ray address to join; default: the spec's, else a local Ray.")
@click.option("--no-progress", is_flag=True, help="Do not show the progress bar / lines.")
@click.option("--no-report", is_flag=True, help="Do not write _report/report.json and .html at the end.")
def run(job_file: str, overrides: tuple[str, ...], address: str | None, no_progress: bool,
        no_report: bool) -> None:
    """Run JOB_FILE on a local Ray instance (or the cluster at --address); exit 1 if any shard failed."""
    from jobrunner.driver.job import run_job
    from jobrunner.driver.manifest import ResumeError
    from jobrunner.driver.plan import OutputError
    from jobrunner.io.lease import LeaseLost
    from jobrunner.io.reader import InputError
    from jobrunner.io.storage import StorageError

    spec = _load(job_file, overrides)
    try:
        result = run_job(spec, address=address, show_progress=not no_progress)
    except (InputError, OutputError, ResumeError, StorageError, LeaseLost) as exc:
        raise click.ClickException(str(exc)) from None
    if not no_report:
        _write_report(spec)
    click.echo(redact_text(result.summary()))  # Ray job logs are readable by whoever can list jobs
    if not result.ok:
        raise click.ClickException(result.failure_message())


def _write_report(spec) -> None:
    """Write _report/report.json and _report/report.html under the output; a report problem never fails the job."""
    from jobrunner.io.layout import REPORT_FILES

    try:
        from jobrunner.reports import write_job_report
    except ImportError:
        return
    try:
        report = write_job_report(spec.output.url, spec.output.storage_options, spec.cost.worker_hour_usd)
    except Exception as exc:  # noqa: BLE001 - the job's outputs are done; the report is a bonus
        report = {"error": str(exc)}
    if isinstance(report, dict) and report.get("error"):
        click.echo(f"warning: report not written: {report['error']}", err=True)
    else:
        click.echo(f"report: {spec.output.url.rstrip('/')}/{REPORT_FILES[1]}")


@click.command()
@click.argument("job_file", type=click.Path(dir_okay=False, exists=True))
@_set_option
@click.option("--address", required=True, help="Ray dashboard address, e.g. http://HEAD:8265.")
@click.option("--wait", is_flag=True, help="Follow the job's logs and exit with its status.")
@click.option("--auth-token", default=None, envvar="RAY_AUTH_TOKEN",
              help="Ray auth token (default: $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token).")
@click.option("--working-dir", default=None, help="Directory uploaded as the job's working_dir.")
@click.option("--python", "python", default=None, metavar="PATH",
              help="Python on the head that has jobrunner (default: found there; see docs/driver.md).")
def submit(job_file: str, overrides: tuple[str, ...], address: str, wait: bool, auth_token: str | None,
           working_dir: str | None, python: str | None) -> None:
    """Submit JOB_FILE as a Ray job through the Job Submission API; print the job id.

    The spec is sent as written: secrets must be ${env:NAME} references, resolved on the head.
    """
    from jobrunner.driver.submit import SubmitError, follow_job, submit_job

    try:
        load_spec(job_file, overrides, resolve_env=False)  # validate here; ${env:NAME} stays unresolved
        data, _ = load_spec_data(job_file, overrides)
    except SpecError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        client, job_id = submit_job(data, address, auth_token=auth_token, working_dir=working_dir,
                                    python=python)
    except SubmitError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(job_id)
    if wait:
        status = follow_job(client, job_id, sys.stdout)
        if status != "SUCCEEDED":
            raise click.ClickException(f"Ray job {job_id} ended with status {status}")


COMMANDS = [run, validate, submit]
