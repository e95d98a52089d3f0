"""The trend of a series of runs (`report --trend`, or a glob of outputs) as text, markdown, JSON and HTML."""

from __future__ import annotations

import json
from html import escape

from jobrunner.reports.svg import PALETTE, Series, empty_chart, point_chart
from jobrunner.reports.table import fmt_float, fmt_pct, fmt_seconds, fmt_text, fmt_usd
from jobrunner.reports.text import _finite
from jobrunner.reports.trend import TREND_FIGURES, trend_points

AXIS_FORMATTERS = {"tokens_per_s": lambda v: fmt_float(v, 0), "rows": lambda v: f"{v:,.0f}"}
FORMATTERS = {"usd_per_m_tokens": fmt_usd, "tokens_per_s": fmt_float, "error_rate": fmt_pct,
              "stopped_at_max_tokens_rate": fmt_pct, "json_valid_rate": fmt_pct,
              "prefix_cache_hit_rate": fmt_pct, "rows": lambda v: fmt_text(v), "wall_s": fmt_seconds,
              "job_cost_usd": fmt_usd, "output_tokens_per_s": fmt_float}
COLUMNS = ("date", "label", "rows", "usd_per_m_tokens", "error_rate", "stopped_at_max_tokens_rate",
           "json_valid_rate", "tokens_per_s", "prefix_cache_hit_rate", "wall_s", "job_cost_usd", "hardware", "dtype")
TITLES = {"date": "date", "label": "run", "rows": "rows", "usd_per_m_tokens": "$ / M tokens",
          "error_rate": "error share", "stopped_at_max_tokens_rate": "at max_tokens",
          "json_valid_rate": "JSON valid", "tokens_per_s": "tokens/s", "prefix_cache_hit_rate": "cache hit rate",
          "wall_s": "wall time", "job_cost_usd": "job cost", "hardware": "hardware", "dtype": "dtype"}
# why a chart has no dot at all
NO_VALUES = {"json_valid_rate": "no row had a JSON schema (sampling.json_schema or a per-row schema)",
             "usd_per_m_tokens": "no cost: give --worker-hour-usd (or cost.worker_hour_usd in the spec)"}
NOWRAP = ' style="white-space:nowrap"'  # a date or a run's name on one line
X_LABEL = "night (logical date: {date} / $JOBRUNNER_DATE)"


def _cells(point: dict) -> list[str]:
    return [FORMATTERS.get(key, fmt_text)(point.get(key)) for key in COLUMNS]


def render_trend_json(reports: list[dict]) -> str:
    """{"trend": [point per run, oldest first]} (raw numbers)."""
    return json.dumps(_finite({"trend": trend_points(reports)}), indent=2, allow_nan=False, default=str) + "\n"


def render_trend_text(reports: list[dict]) -> str:
    """An aligned table, a row per run, oldest first."""
    rows = [[TITLES[k] for k in COLUMNS]] + [_cells(p) for p in trend_points(reports)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows) + "\n"


def render_trend_markdown(reports: list[dict]) -> str:
    """A markdown table, a row per run, oldest first."""
    lines = ["# jobrunner trend", "", "| " + " | ".join(TITLES[k] for k in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(p)) + " |" for p in trend_points(reports)]
    return "\n".join(lines) + "\n"


def x_labels(points: list[dict]) -> list[str]:
    """The x axis: each run's logical date; a date that several runs share gets their start times (HH:MM)."""
    dates = [p["date"] or p["label"] for p in points]
    return [f"{d} {(p['started_at'] or '')[11:16]}".rstrip() if dates.count(d) > 1 else d
            for d, p in zip(dates, points, strict=True)]


def trend_charts(points: list[dict]) -> list[str]:
    """One chart per trend figure, a dot per night that has a value (a 0-row night: only on `rows`)."""
    categories = x_labels(points)
    charts = []
    for i, (key, title, _) in enumerate(TREND_FIGURES):
        values = [p[key] for p in points]
        if all(v is None for v in values):
            charts.append(empty_chart(title, NO_VALUES.get(key, "no values")))
            continue
        series = [Series(title, list(range(len(points))), values, PALETTE[i % len(PALETTE)])]
        charts.append(point_chart(title, categories, series, "", AXIS_FORMATTERS.get(key, FORMATTERS[key]),
                                  x_label=X_LABEL))
    return charts


def _subtitle(points: list[dict]) -> str:
    dates = [p["date"] for p in points if p["date"]]
    span = f"from {dates[0]} to {dates[-1]}" if dates else "without dates"
    empty = [p["date"] or p["label"] for p in points if p["rows"] == 0]
    note = f"; 0 rows (nothing to do, or nothing committed): {', '.join(empty)}" if empty else ""
    return (f"{len(points)} runs {span}, by each run's logical date ({{date}} / $JOBRUNNER_DATE, recorded in its "
            f"manifest); one dot per run, oldest left{note}")


def render_trend_html(reports: list[dict]) -> str:
    """One chart per trend figure (a dot per night) and the table."""
    from jobrunner.reports.html import STYLE

    points = trend_points(reports)
    names = sorted({str(p["label"]).split(" [")[0] for p in points})
    title = f"jobrunner trend: {', '.join(names)} ({len(points)} runs)"
    head = "<tr>" + "".join(f"<th>{escape(TITLES[k])}</th>" for k in COLUMNS) + "</tr>"
    body = "".join("<tr>" + "".join(f'<td class="num"{NOWRAP if k in ("date", "label") else ""}>{escape(c)}</td>'
                                    for k, c in zip(COLUMNS, _cells(p), strict=True)) + "</tr>" for p in points)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>"
            f"<h1>{escape(title)}</h1><div class=\"sub\">{escape(_subtitle(points))}</div>"
            f'<div class="charts">{"".join(trend_charts(points))}</div><h2>Runs</h2>'
            f'<table class="trend">{head}{body}</table></body></html>\n')
