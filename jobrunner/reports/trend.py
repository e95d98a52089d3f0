"""A series of runs of one job (e.g. `report 'out/nightly/*'`) as a trend keyed by each run's logical date (the
`{date}` / `$JOBRUNNER_DATE` it ran for, which the manifest records; its start date for older outputs): rows,
$ / M tokens, error share, share stopped at max_tokens, JSON-valid share, tokens/s and prefix-cache hit rate per
night, as a table and charts; and any set of runs as CSV (one row per run). A night with nothing to do is a
point of 0 rows (its shares are undefined, not zero)."""

from __future__ import annotations

import csv
import io

from jobrunner.reports.table import FIGURES, run_labels

# (key, chart title, path in the report): one chart each, in this order
TREND_FIGURES = (
    ("rows", "rows per night", ("rows", "total")),
    ("usd_per_m_tokens", "$ / M tokens (blended)", ("cost", "usd_per_m_total")),
    ("error_rate", "error share (rows)", ("rows", "error_rate")),
    ("stopped_at_max_tokens_rate", "share stopped at max_tokens", ("rows", "stopped_at_max_tokens_rate")),
    ("json_valid_rate", "JSON-valid share (rows with a schema)", ("rows", "json_valid_rate")),
    ("tokens_per_s", "tokens/s (input + output)", ("throughput", "tokens_per_s")),
    ("prefix_cache_hit_rate", "prefix-cache hit rate", ("tokens", "prefix_cache_hit_rate")),
)
EXTRA_FIGURES = (
    ("output_tokens_per_s", ("throughput", "output_tokens_per_s")),
    ("wall_s", ("time", "wall_s")), ("job_cost_usd", ("cost", "total_usd")),
)


def _at(report: dict, path: tuple[str, ...]) -> object:
    value: object = report
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def by_date(reports: list[dict]) -> list[dict]:
    """The runs ordered by logical date, then start time (runs without a date last, in the given order)."""
    def key(report: dict) -> tuple:
        run = report["run"]
        return run.get("date") is None, run.get("date") or "", run.get("started_at") or ""

    return sorted(reports, key=key)


def trend_points(reports: list[dict]) -> list[dict]:
    """One point per run, oldest night first: date, label, url and the trend figures (None where unknown)."""
    ordered = by_date(reports)
    points = []
    for label, report in zip(run_labels(ordered), ordered, strict=True):
        run = report["run"]
        point = {"date": run.get("date"), "started_at": run.get("started_at"), "label": label, "url": run["url"],
                 "complete": run.get("complete"), "hardware": (run.get("hardware") or {}).get("summary"),
                 "dtype": run["model"].get("dtype"), "jobrunner_version": run.get("jobrunner_version")}
        point.update({key: _at(report, path) for key, _, path in TREND_FIGURES})
        point.update({key: _at(report, path) for key, path in EXTRA_FIGURES})
        if point["rows"] == 0:  # a night with nothing to do: no speed to chart (0 tokens over a few ms)
            point.update(tokens_per_s=None, output_tokens_per_s=None)
        points.append(point)
    return points


RUN_COLUMNS = ("label", "url", "date", "started_at", "jobrunner_version", "hardware", "dtype", "complete")


def render_csv(reports: list[dict]) -> str:
    """One row per run: who/when/where columns, then every figure of the report table (raw numbers)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    figure_names = [f"{f.section}: {f.label}" for f in FIGURES]
    writer.writerow([*RUN_COLUMNS, *figure_names])
    for label, report in zip(run_labels(reports), reports, strict=True):
        run = report["run"]
        meta = [label, run["url"], run.get("date"), run.get("started_at"), run.get("jobrunner_version"),
                (run.get("hardware") or {}).get("summary"), run["model"].get("dtype"), run.get("complete")]
        writer.writerow([_cell(v) for v in meta + [f.value(report) for f in FIGURES]])
    return out.getvalue()


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    return str(value)
