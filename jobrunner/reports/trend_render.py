"""The trend of a series of runs (`report --trend`, or a glob of outputs) as text, markdown, JSON and HTML."""

from __future__ import annotations

import json
from html import escape

from jobrunner.reports.svg import PALETTE, Series, point_chart
from jobrunner.reports.table import fmt_float, fmt_pct, fmt_seconds, fmt_text, fmt_usd
from jobrunner.reports.text import _finite
from jobrunner.reports.trend import TREND_FIGURES, trend_points

AXIS_FORMATTERS = {"tokens_per_s": lambda v: fmt_float(v, 0)}
FORMATTERS = {"usd_per_m_tokens": fmt_usd, "tokens_per_s": fmt_float, "error_rate": fmt_pct,
              "prefix_cache_hit_rate": fmt_pct, "rows": lambda v: fmt_text(v), "wall_s": fmt_seconds,
              "job_cost_usd": fmt_usd, "output_tokens_per_s": fmt_float}
COLUMNS = ("date", "label", "usd_per_m_tokens", "tokens_per_s", "error_rate", "prefix_cache_hit_rate", "rows",
           "wall_s", "job_cost_usd", "hardware", "dtype")
TITLES = {"date": "date", "label": "run", "usd_per_m_tokens": "$ / M tokens", "tokens_per_s": "tokens/s",
          "error_rate": "error rate", "prefix_cache_hit_rate": "cache hit rate", "rows": "rows",
          "wall_s": "wall time", "job_cost_usd": "job cost", "hardware": "hardware", "dtype": "dtype"}


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


def render_trend_html(reports: list[dict]) -> str:
    """Four charts (one per trend figure, a dot per run date) and the table."""
    from jobrunner.reports.html import STYLE

    points = trend_points(reports)
    names = sorted({str(p["label"]).split(" [")[0] for p in points})
    title = f"jobrunner trend: {', '.join(names)} ({len(points)} runs)"
    dates = [p["date"] or p["label"] for p in points]
    if len(set(dates)) < len(dates):  # several runs a day: their start times (MM-DD HH:MM)
        dates = [(p["started_at"] or "")[5:16].replace("T", " ") or p["label"] for p in points]
    charts = [point_chart(chart_title, dates, [Series(chart_title, list(range(len(points))),
                                                      [p[key] for p in points], PALETTE[i])],
                          "", AXIS_FORMATTERS.get(key, FORMATTERS[key]))
              for i, (key, chart_title, _) in enumerate(TREND_FIGURES)]
    head = "<tr>" + "".join(f"<th>{escape(TITLES[k])}</th>" for k in COLUMNS) + "</tr>"
    body = "".join("<tr>" + "".join(f'<td class="num">{escape(c)}</td>' for c in _cells(p)) + "</tr>"
                   for p in points)
    first, last = points[0], points[-1]
    sub = (f"{len(points)} runs from {escape(fmt_text(first['started_at']))} to "
           f"{escape(fmt_text(last['started_at']))}; one dot per run, oldest left")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>"
            f"<h1>{escape(title)}</h1><div class=\"sub\">{sub}</div>"
            f'<div class="charts">{"".join(charts)}</div><h2>Runs</h2>'
            f'<table class="trend">{head}{body}</table></body></html>\n')
