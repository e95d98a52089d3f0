"""`jobrunner status OUTPUT_URL`: prompts / samples done, errors, speed, ETA, workers and lease of a running or finished
job."""

from __future__ import annotations

import json
from typing import Any

import click

from jobrunner.cli.echo import echo
from jobrunner.cli.report import _storage_options


@click.command()
@click.argument("output_url", metavar="OUTPUT_URL|JOB_SPEC")
@click.option("--storage-options", callback=_storage_options, default=None,
              help="JSON object of fsspec storage options (e.g. an S3 endpoint_url).")
@click.option("--json", "as_json", is_flag=True, help="Print the status as one JSON object.")
def status(output_url: str, storage_options: dict | None, as_json: bool) -> None:
    """Where the job writing OUTPUT_URL stands: reads _manifest.json, _commits/ and _lease.json, never a part.

    A job spec (nightly.yaml) stands for its output.url, {date} filled as a run now would ($JOBRUNNER_DATE).
    """
    from jobrunner.cli.spec_output import output_of
    from jobrunner.io.report_reader import ReportInputError, read_output_state
    from jobrunner.reports.status import job_status

    output_url, storage_options = output_of(output_url, storage_options)
    if _pipeline_status(output_url, storage_options, as_json):
        return
    try:
        state = read_output_state(output_url, storage_options)
    except (ReportInputError, OSError) as exc:
        raise click.ClickException(str(exc) if output_url in str(exc) else f"{output_url}: {exc}") from None
    report = job_status(state)
    echo(json.dumps(report, default=str) if as_json else render_status(report))


def _pipeline_status(url: str, storage_options: dict | None, as_json: bool) -> bool:
    """A pipeline's output (`_pipeline.json`): each stage's status, under its name, and the funnel so far;
    False for a job's output."""
    from jobrunner.driver.pipeline import funnel_lines
    from jobrunner.io.report_reader import ReportInputError, read_output_state
    from jobrunner.io.stage_input import pipeline_funnel, read_pipeline
    from jobrunner.io.storage import Storage
    from jobrunner.reports.status import job_status

    root = Storage(url, storage_options)
    record = read_pipeline(root)
    if record is None:
        return False
    stages, texts, previous = [], [], None
    for stage in record.get("stages", []):
        try:
            report = job_status(read_output_state(f"{url.rstrip('/')}/{stage['url']}", storage_options))
            texts.append(f"[stage {stage['name']}]\n{render_status(report, waits_for=previous)}")
        except (ReportInputError, OSError) as exc:
            report = None
            texts.append(f"[stage {stage['name']}]\nnot started: {exc}")
        stages.append({"name": stage["name"], "status": report})
        previous = stage["name"]
    funnel = pipeline_funnel(root, [s["name"] for s in record.get("stages", [])])
    state = "complete (_SUCCESS written)" if root.exists("_SUCCESS") else "not complete"
    if as_json:
        echo(json.dumps({"pipeline": record.get("name"), "url": url, "state": state, "stages": stages,
                         "funnel": funnel}, default=str))
    else:
        echo("\n\n".join([f"pipeline {record.get('name')} at {url}: {state}", *texts, *funnel_lines(funnel)]))
    return True


def render_status(s: dict[str, Any], waits_for: str | None = None) -> str:
    """The status as aligned `key  value` lines, in the words and numbers of the run's own log
    (jobrunner/progress_view.py). `waits_for`: a pipeline stage's previous stage (a stage with no shard yet
    waits for that stage's committed rows, with no ETA)."""
    from jobrunner.progress_view import counts_from_dict

    counts = counts_from_dict(s.get("counts"))
    if waits_for and s["state"] != "complete" and (counts is None or not counts.prompts_total):
        return _waiting_status(s, waits_for)
    rows = s["rows"]
    share = "n/a" if rows["error_share"] is None else f"{100 * rows['error_share']:.1f}%"
    lines = [("output", s["url"]), ("job", f"{s['job_name'] or 'n/a'} (model {s['model']['source'] or 'n/a'}, "
                                           f"dtype {s['model']['dtype'] or 'n/a'})"),
             ("state", _state_line(s)), ("done", _done_line(s, counts)),
             ("errors", f"{rows['errors']:,} error rows ({share} of the rows written)"),
             ("shards", ", ".join(f"{n} {k}" for k, n in sorted(s["shards"].items())) or "none"),
             ("tokens", f"prompt {s['tokens']['prompt']:,} (cached {s['tokens']['cached']:,}), "
                        f"output {s['tokens']['output']:,}"),
             ("speed", _speed_line(s["speed"], counts)), ("ETA", _eta(s)), ("workers", _workers_line(s["workers"])),
             ("lease", _lease_line(s["lease"]))]
    lines += [("error", f"{count:,} x {kind}") for kind, count in rows["top_error_kinds"].items()]
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in lines)


def _waiting_status(s: dict[str, Any], waits_for: str) -> str:
    """A pipeline stage with no shard yet: what it waits for, its state and lease (no ETA: it has no rows)."""
    lines = [("output", s["url"]), ("state", _state_line(s)),
             ("done", f"nothing yet: waits for stage {waits_for}'s committed rows (none handed on so far)"),
             ("ETA", f"n/a (starts once stage {waits_for} commits a shard with rows that pass its filter)"),
             ("lease", _lease_line(s["lease"]))]
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in lines)


def _done_line(s: dict[str, Any], counts: Any) -> str:
    """'prompts 13/40 · samples 39/120 (33%) [the driver's count, 4 s ago]', or '... committed (33%)'."""
    if counts is None or not counts.prompts_total:
        return "complete" if s["state"] == "complete" else "planning: no shard recorded yet"
    live = s.get("live")
    if not live:
        return counts.text("" if counts.is_done else "committed")
    age = "" if live.get("age_s") is None else f", {live['age_s']:,.0f} s ago"
    return counts.text() + f" [the driver's count{age}: committed rows and rows finished in running shards]"


def _state_line(s: dict[str, Any]) -> str:
    text = {"complete": "complete (_SUCCESS written)",
            "running": "running",
            "stale": "stale: the lease expired without a heartbeat (its driver died?); a new run takes it over",
            "incomplete": "not running, not complete (stopped, failed shards, or over the error budget)"}
    line = text.get(s["state"], s["state"])
    if s["state"] == "running" and s.get("phase") and s["phase"] != "running":
        line += f" ({s['phase']})"
    if s.get("finished_at"):
        line += f", finished {s['finished_at']}"
    return line + f", started {s.get('started_at') or 'n/a'}, run {s.get('run_count') or 'n/a'}"


def _speed_line(speed: dict[str, Any], counts: Any) -> str:
    if speed["tokens_per_s"] is None:
        return speed["basis"]
    unit = "prompts" if counts is not None and counts.shows_samples else "rows"
    tokens = f"{speed['tokens_per_s']:,.1f} {speed['tokens_kind']} tok/s"
    if speed.get("tokens_window_s"):  # the driver's rate, as its log shows it
        tokens += f" (the driver's, over its last {speed['tokens_window_s']:.0f} s)"
    return f"{tokens}, {speed['prompts_per_s']:,.2f} {unit}/s ({speed['basis']}, {speed['elapsed_s']:,.0f} s)"


def _eta(s: dict[str, Any]) -> str:
    from jobrunner.progress_view import duration

    eta = s["speed"]["eta_s"]
    if eta is None:
        return "n/a" if s["state"] != "running" else "n/a (no row done in this run yet)"
    if eta == 0:
        return "done" if s["state"] == "complete" or not s.get("live") else "any moment"
    return duration(eta) + (" (the driver's estimate, less the time since)" if s.get("live") else "")


def _workers_line(w: dict[str, Any]) -> str:
    run = f"run {w['run_index'] + 1}"
    if w["count"] and not w["ids"]:
        return f"{w['count']} in {run} (named once they commit a shard)"
    if not w["count"]:
        return f"none in {run} yet (workers are named once they commit a shard); {w['recorded_all_runs']} over all runs"
    if w.get("ranks"):  # tensor-parallel workers: each with its ranks ("w0 (2 ranks x cpu, cores [0] [1])")
        from jobrunner.reports.parallel_view import describe_ranks

        named = [f"{wid} ({describe_ranks(w['ranks'][wid])})" if wid in w["ranks"] else wid for wid in w["ids"]]
        return f"{w['count']} in {run}: {', '.join(named)} on {', '.join(w['nodes'])}"
    devices = ", ".join(f"{n} x {d}" for d, n in sorted(w["devices"].items()))
    where = f" ({devices}) on {', '.join(w['nodes'])}" if devices else " (devices not recorded yet)"
    return f"{w['count']} in {run}: {', '.join(w['ids'])}{where}"


def _lease_line(lease: dict[str, Any] | None) -> str:
    if lease is None:
        return "none (no run holds this output)"
    if lease["state"] == "released":
        return (f"none (no run holds this output; the last, run {lease['run_id']} (generation "
                f"{lease['generation']}), released it at {lease['heartbeat_at']})")
    age = "n/a" if lease["heartbeat_age_s"] is None else f"{lease['heartbeat_age_s']:,.0f} s ago"
    left = lease["expires_in_s"]
    expiry = "n/a" if left is None else (
        f"expired {-left:,.0f} s ago" if lease["expired"] else f"expires in {left:,.0f} s")
    generation = "" if lease["generation"] is None else f", generation {lease['generation']}"
    return (f"run {lease['run_id']} on {lease['host']} (pid {lease['pid']}){generation}, last heartbeat "
            f"{lease['heartbeat_at']} ({age}), {expiry}")


COMMANDS = [status]
