"""`jobrunner status OUTPUT_URL`: rows done, errors, speed, ETA, workers and lease of a running or finished job."""

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
    try:
        state = read_output_state(output_url, storage_options)
    except (ReportInputError, OSError) as exc:
        raise click.ClickException(str(exc) if output_url in str(exc) else f"{output_url}: {exc}") from None
    report = job_status(state)
    echo(json.dumps(report, default=str) if as_json else render_status(report))


def render_status(s: dict[str, Any]) -> str:
    """The status as aligned `key  value` lines."""
    rows, speed = s["rows"], s["speed"]
    share = "n/a" if rows["error_share"] is None else f"{100 * rows['error_share']:.1f}%"
    if rows["total"]:
        pct = f"{100 * rows['done'] / rows['total']:.1f}%"
    else:
        pct = "complete" if s["state"] == "complete" else "planning: no shard recorded yet"
    lines = [("output", s["url"]), ("job", f"{s['job_name'] or 'n/a'} (model {s['model']['source'] or 'n/a'}, "
                                           f"dtype {s['model']['dtype'] or 'n/a'})"),
             ("state", _state_line(s)),
             ("rows", f"{rows['done']:,}/{rows['total']:,} ({pct}), {rows['errors']:,} errors ({share})"
                      + (" [live, from the driver's heartbeat]" if s.get("live") else "")),
             ("shards", ", ".join(f"{n} {k}" for k, n in sorted(s["shards"].items())) or "none"),
             ("tokens", f"prompt {s['tokens']['prompt']:,} (cached {s['tokens']['cached']:,}), "
                        f"output {s['tokens']['output']:,}"),
             ("speed", _speed_line(speed)), ("ETA", _eta(s)), ("workers", _workers_line(s["workers"])),
             ("lease", _lease_line(s["lease"]))]
    lines += [("error", f"{count:,} x {kind}") for kind, count in rows["top_error_kinds"].items()]
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in lines)


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


def _speed_line(speed: dict[str, Any]) -> str:
    if speed["output_tokens_per_s"] is None:
        return speed["basis"]
    return (f"{speed['output_tokens_per_s']:,.1f} output tok/s, {speed['rows_per_s']:,.2f} rows/s "
            f"({speed['basis']}, {speed['elapsed_s']:,.0f} s)")


def _eta(s: dict[str, Any]) -> str:
    eta = s["speed"]["eta_s"]
    if eta is None:
        return "n/a" if s["state"] != "running" else "n/a (no row committed in this run yet)"
    return "done" if eta == 0 else f"{eta:,.0f} s"


def _workers_line(w: dict[str, Any]) -> str:
    if w["count"] and not w["ids"]:
        return (f"{w['count']} in run {w['run_index'] + 1} (driver heartbeat; ids and devices recorded at the next "
                f"compaction)")
    if not w["count"]:
        return (f"none recorded for run {w['run_index'] + 1} yet (the manifest is compacted every so many commits); "
                f"{w['recorded_all_runs']} over all runs")
    devices = ", ".join(f"{n} x {d}" for d, n in sorted(w["devices"].items()))
    where = f" ({devices}) on {', '.join(w['nodes'])}" if devices else " (devices recorded at the next compaction)"
    return f"{w['count']} in run {w['run_index'] + 1}: {', '.join(w['ids'])}{where}"


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
