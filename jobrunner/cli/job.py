"""`jobrunner run | validate | submit`: thin commands over jobrunner.driver."""

from __future__ import annotations

import sys
import time

import click

from jobrunner.cli.echo import echo
from jobrunner.spec import SpecError, load_spec, load_spec_data

_set_option = click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
                           help="Override a spec field, e.g. --set sampling.max_tokens=32 (repeatable).")


def _error(exc: BaseException | str) -> click.ClickException:
    """An error for the user (redacted when printed: jobrunner.cli._Main, cli/echo.py)."""
    return click.ClickException(str(exc))


_limit_option = click.option("--limit", type=click.IntRange(min=1), default=None, metavar="N",
                             help="Only the first N input rows (a smoke run; same as --set input.limit=N).")


def _load(path: str, overrides: tuple[str, ...], limit: int | None = None):
    if limit is not None:
        overrides = (*overrides, f"input.limit={limit}")
    try:
        return load_spec(path, overrides)
    except SpecError as exc:
        raise _error(exc) from None


def _check_model(spec) -> str:
    """What the model source is (alias, local dir, URL, Hub id), checked without loading weights; a typo fails
    here, before any worker starts. A custom engine.factory may take any source: not checked then."""
    if spec.engine.factory:
        return f"{spec.model.source!r} (not checked: engine.factory {spec.engine.factory} builds the engine)"
    if spec.engine.backend == "openai":  # the endpoint serves its own model: nothing here to check
        endpoint = spec.engine.endpoint
        return f"{endpoint.model!r} at {endpoint.base_url} (engine.backend openai; not contacted by this check)"
    from jobrunner.driver.chat_check import chat_template_problem
    from jobrunner.driver.row_check import job_constraint_problem
    from jobrunner.models.sources import ModelSourceError, check_model_source

    # a base model given chat rows, a schema the grammar refuses: every row an error row, refused before any worker
    problem = chat_template_problem(spec) or job_constraint_problem(spec)
    if problem:
        raise _error(problem)

    try:
        described = check_model_source(spec.model.source)
    except ModelSourceError as exc:
        raise _error(f"model.source: {exc}") from None
    if spec.engine.backend == "vllm":
        return described + _check_vllm(spec)
    return described + _check_model_config(spec) + _check_draft_source(spec.engine.speculative) + \
        _check_adapter_sources(spec.model.adapters)


def _refuse_batch_chat_lines(spec) -> None:
    """An OpenAI batch file of chat lines for a model without a chat template: refused before any worker."""
    from jobrunner.cli.validate_rows import batch_chat_problem

    problem = batch_chat_problem(spec)
    if problem:
        raise _error(problem)


def _check_vllm(spec) -> str:
    """'; engine: vLLM 0.32.0 at PYTHON (it checks the architecture at load)': vLLM is there for the Python
    workers will use, and engine.vllm_options are vLLM's own names; with tensor / pipeline ranks, the split and
    the bytes per GPU from the model's config.json (cli/validate_parallel.py)."""
    from jobrunner.cli.validate_parallel import vllm_section
    from jobrunner.vllm_backend.mapping import describe_vllm, vllm_python

    try:
        return f"; engine: {describe_vllm(vllm_python(spec), spec.engine.vllm_options)} (vLLM checks the " \
               "architecture when it loads the model)" + vllm_section(spec)
    except ValueError as exc:  # no vLLM there, an unknown option, a rank's share that does not fit the GPU
        raise _error(str(exc)) from None


def _check_model_config(spec) -> str:
    """'; <architecture, size, context>' from the model's config.json alone (models/preflight.py): an
    architecture, rope scaling or context length a worker would refuse is refused here, before any download."""
    from jobrunner.cli.validate_fit import fit_section
    from jobrunner.models.preflight import ConfigUnavailable, preflight
    from jobrunner.models.sources import ModelSourceError

    try:
        check = preflight(spec.model.source, spec.engine.max_model_len)
    except ModelSourceError as exc:
        raise _error(f"model.source: {exc}") from None
    except ConfigUnavailable as exc:
        from jobrunner.cli.validate_parallel import unchecked_note

        return f" (config not checked: {exc}; each worker downloads and checks it)" + unchecked_note(spec)
    if check is None:
        return " (its architecture is checked when the alias is converted, on first load)"
    try:
        return "\n  " + check.describe(spec.model.dtype, spec.model.quantization) + fit_section(spec, check)
    except ValueError as exc:  # model.quantization conflicts with a pre-quantized checkpoint's own; no fit
        raise _error(str(exc)) from None


def _check_adapter_sources(adapters: dict[str, str]) -> str:
    """'; adapter <name>: <what it is>' for each LoRA adapter (a local one's config checked now)."""
    from jobrunner.models.adapter_sources import check_adapter_source

    lines = []
    for name, source in adapters.items():
        try:
            lines.append(f"\n  adapter {name}: {check_adapter_source(name, source)}")
        except ValueError as exc:  # ModelSourceError, an unsupported adapter config
            raise _error(f"model.adapters.{name}: {exc}") from None
    return "".join(lines)


def _check_draft_source(speculative: str) -> str:
    """'; draft model <what it is>' when engine.speculative names a draft model (checked as model.source is)."""
    from jobrunner.engine.config import SPECULATIVE_MODES, is_draft_source
    from jobrunner.models.sources import ModelSourceError, check_model_source

    if not is_draft_source(speculative):
        return ""
    try:
        return f"; draft model {check_model_source(speculative)}"
    except ModelSourceError as exc:
        raise _error(f"engine.speculative: {exc} (engine.speculative is {'|'.join(SPECULATIVE_MODES)} or a "
                     "draft model source)") from None


def _user_error(spec, exc: Exception) -> click.ClickException:
    """A ClickException for an input / output / storage problem, saying what a relative local path is relative
    to (the current directory, not the spec file's)."""
    from jobrunner.cli.paths import relative_path_note

    return _error(str(exc) + relative_path_note(spec, str(exc)))


def _bad_lines(f) -> str:  # noqa: ANN001 - an io.reader.InputFile
    """', 2 bad line(s) (each becomes an error row): line 3 ...; line 9 ...' for a text file with bad lines."""
    if not f.num_bad_lines:
        return ""
    more = f"; ... {f.num_bad_lines - len(f.first_bad_lines)} more" if f.num_bad_lines > len(f.first_bad_lines) else ""
    return (f", {f.num_bad_lines} bad line(s) (each becomes an error row): "
            f"{'; '.join(f.first_bad_lines)}{more}")


@click.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@_limit_option
@click.option("--check-ids", is_flag=True, help="Kept for old scripts: ids are always checked now.")
def validate(job_file: str, overrides: tuple[str, ...], limit: int | None, check_ids: bool) -> None:
    """Check JOB_FILE, its model source (without loading weights), input (files, rows, shards, columns, unique
    ids) and output, without starting any worker."""
    from jobrunner.cli.validate_rows import columns_line, row_lines
    from jobrunner.driver.manifest import ResumeError
    from jobrunner.driver.output import OutputError, describe_output, read_previous_output
    from jobrunner.driver.plan import describe_empty, plan_job
    from jobrunner.io.reader import InputError
    from jobrunner.io.storage import StorageError

    spec = pipeline = _load(job_file, overrides, limit)
    if pipeline.stages:  # the first stage reads the input as a job does (cli/validate_stages.py: the rest)
        spec = pipeline.stage_specs()[0]
    model = _check_model(spec)
    started = time.perf_counter()
    try:
        previous = read_previous_output(spec)
        plan = plan_job(spec, previous.header)  # duplicate ids included: every run checks them
        plan_s = time.perf_counter() - started
        output_state = describe_output(spec, plan, previous)
    except (InputError, OutputError, ResumeError, StorageError) as exc:
        raise _user_error(spec, exc) from None
    echo(f"job {spec.name!r}: spec OK")
    echo(f"model {model}")
    num_bytes = sum(f.num_bytes for f in plan.files)
    limited = f" (the first {spec.input.limit}: input.limit)" if spec.input.limit is not None else ""
    echo(f"input {spec.input.url}: {len(plan.files)} file(s), {plan.num_rows} rows{limited}, "
         f"{len(plan.shards)} shard(s) of about {spec.rows_per_shard} rows ({num_bytes} bytes, "
         f"planned in {plan_s:.2f}s)")
    for f in plan.files:
        if not f.num_rows:
            echo(f"  {describe_empty([f])}: empty, skipped")
            continue
        echo(f"  {f.url}: {f.num_rows} rows, {len(f.row_group_num_rows)} row group(s)" + _bad_lines(f))
    echo(columns_line(spec))
    lines, refused = row_lines(spec, plan)  # cli/validate_rows.py: the rows a worker would refuse, prompt lengths
    for line in lines:
        echo(line)
    echo(f"output {spec.output.url} (mode {spec.output.mode}): {output_state}")
    if pipeline.stages:
        from jobrunner.cli.validate_stages import stage_lines

        lines, refused_stages = stage_lines(pipeline, plan, _check_model)
        for line in lines:
            echo(line)
        refused = refused or refused_stages
    if refused:
        raise _error(refused)


@click.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@_limit_option
@click.option("--address", default=None, help="Ray address to join; default: the spec's, else a local Ray.")
@click.option("--no-progress", is_flag=True, help="Do not show the progress bar / lines.")
@click.option("--no-report", is_flag=True, help="Do not write _report/report.json and .html at the end.")
def run(job_file: str, overrides: tuple[str, ...], limit: int | None, address: str | None, no_progress: bool,
        no_report: bool) -> None:
    """Run JOB_FILE on a local Ray instance (or the cluster at --address); exit 1 if any shard failed."""
    from jobrunner.driver.job import run_job
    from jobrunner.driver.manifest import ResumeError
    from jobrunner.driver.output import OutputError
    from jobrunner.io.lease import LeaseLost
    from jobrunner.io.reader import InputError
    from jobrunner.io.storage import StorageError

    started_s = _command_started_s()
    spec = _load(job_file, overrides, limit)
    _check_model(spec)
    _refuse_batch_chat_lines(spec)
    try:
        if spec.stages:  # a pipeline: every stage a job under output.url/stages/ (driver/pipeline.py)
            from jobrunner.driver.pipeline import run_pipeline

            result = run_pipeline(spec, address=address, show_progress=not no_progress, started_s=started_s)
        else:
            result = run_job(spec, address=address, show_progress=not no_progress, started_s=started_s)
    except (InputError, OutputError, ResumeError, StorageError, LeaseLost) as exc:
        raise _user_error(spec, exc) from None
    except KeyboardInterrupt:  # click then prints "Aborted!" and exits 1, as before
        echo(interrupt_hint(spec), err=True)
        raise
    if not no_report:
        _write_report(spec)
    # Ray job logs are readable by whoever can list jobs; the failure itself is printed once, by the exception
    echo(result.summary(failures=result.ok))
    if not result.ok:
        raise _error(result.failure_message())


def interrupt_hint(spec) -> str:
    """The line a Ctrl-C'd run ends on: the committed rows are kept, and how a rerun goes on from them (the same
    command, unless output.mode would start over or refuse the output)."""
    kept = f"interrupted: the rows committed so far are kept under {spec.output.url}"
    mode = spec.output.mode
    if mode in ("resume", "incremental"):
        return f"{kept}; run the same command again to resume (committed rows are not redone)"
    then = "starts over" if mode == "overwrite" else "refuses the existing output"
    return f"{kept}; with output.mode {mode} the same command {then}: add --set output.mode=resume to resume"


def _command_started_s() -> float:
    """When this command's process started, on time.monotonic's clock: its elapsed time then counts Python's
    start, imports and checks as `time jobrunner run` does (now, where the process start cannot be read)."""
    try:
        import psutil

        return time.monotonic() - max(time.time() - psutil.Process().create_time(), 0.0)
    except Exception:  # noqa: BLE001 - no psutil, no /proc: count from here
        return time.monotonic()


def _write_report(spec) -> None:
    """Write _report/report.json and _report/report.html under the output; a report problem never fails the job."""
    from jobrunner.io.layout import REPORT_FILES

    try:
        from jobrunner.reports import write_job_report
    except ImportError:
        return
    try:
        if spec.stages:  # every stage's report, and the pipeline's (funnel, $ / M kept rows)
            from jobrunner.reports.pipeline import write_pipeline_report as write_job_report
        report = write_job_report(spec.output.url, spec.output.storage_options, spec.cost.worker_hour_usd)
    except Exception as exc:  # noqa: BLE001 - the job's outputs are done; the report is a bonus
        report = {"error": str(exc)}
    if isinstance(report, dict) and report.get("error"):
        echo(f"warning: report not written: {report['error']}", err=True)
    else:
        echo(f"report: {spec.output.url.rstrip('/')}/{REPORT_FILES[1]}")


@click.command()
@click.argument("job_file", type=click.Path(dir_okay=False, exists=True))
@_set_option
@click.option("--address", required=True, help="Ray dashboard address, e.g. http://HEAD:8265.")
@click.option("--follow", "--wait", "wait", is_flag=True,
              help="Stream the job's logs, then print its final status; exit 1 unless it SUCCEEDED.")
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
        raise _error(exc) from None
    try:
        client, job_id = submit_job(data, address, auth_token=auth_token, working_dir=working_dir,
                                    python=python)
    except SubmitError as exc:
        raise _error(exc) from None
    echo(job_id)
    if wait:
        try:
            status = follow_job(client, job_id, sys.stdout)
        except SubmitError as exc:
            raise _error(exc) from None
        echo(f"Ray job {job_id} ended: {status}", err=True)
        if status != "SUCCEEDED":
            raise click.ClickException(f"Ray job {job_id} ended with status {status}")


COMMANDS = [run, validate, submit]
