"""The report of a pipeline's output: each stage's report side by side, the funnel, and the pipeline's cost per
million kept rows (the sum of the stages' costs over the rows that passed every filter).

A pipeline's output holds `_pipeline.json` (its stages) and `stages/<name>/` (each a job's output, reported
as any job is, labelled by stage name); the funnel comes from the footers of the files each stage's rows were
handed on to (io/stage_input.py), so it is exact whether or not the pipeline has finished.
"""

from __future__ import annotations

import json
from html import escape
from typing import Any

from jobrunner.io.report_reader import NothingCommittedYet
from jobrunner.io.stage_input import pipeline_funnel, read_pipeline
from jobrunner.io.storage import Storage
from jobrunner.reports.fold import Slo
from jobrunner.reports.html import render_html
from jobrunner.reports.job import load_report
from jobrunner.reports.table import fmt_usd
from jobrunner.reports.text import render_json, render_text

FUNNEL_COLUMNS = (("rows_in", "rows in"), ("kept", "kept"), ("dropped", "dropped by filter"),
                  ("filter_error", "filter errors"), ("error", "error rows"))


def is_pipeline(url: str, storage_options: dict | None = None) -> bool:
    """Whether `url` is a pipeline's output (it holds `_pipeline.json`)."""
    return read_pipeline(Storage(url, storage_options)) is not None


def load_pipeline_report(url: str, storage_options: dict | None = None, worker_hour_usd: float | None = None,
                         slo: Slo | None = None) -> dict[str, Any]:
    """The pipeline's report: its stages (each with its job report, or why there is none yet), the funnel, the
    total cost and $ per million kept rows."""
    root = Storage(url, storage_options)
    record = read_pipeline(root) or {}
    names = [s["name"] for s in record.get("stages", [])]
    funnel = {f["stage"]: f for f in pipeline_funnel(root, names)}
    stages = []
    for stage in record.get("stages", []):
        entry = {**stage, "funnel": funnel[stage["name"]]}
        try:
            entry["report"] = load_report(f"{url.rstrip('/')}/{stage['url']}", storage_options, worker_hour_usd, slo)
            entry["report"]["run"]["label"] = stage["name"]
        except NothingCommittedYet as exc:
            entry["report"], entry["not_reported"] = None, str(exc)
        stages.append(entry)
    costs = [stage_cost(s["report"]) for s in stages]
    total = sum(c for c in costs if isinstance(c, (int, float)))
    kept = funnel[names[-1]]["kept"] if names else 0
    return {"pipeline": record.get("name"), "url": url, "finished": bool(record.get("finished")),
            "stages": stages, "rows_in": funnel[names[0]]["rows_in"] if names else 0, "rows_kept": kept,
            "total_usd": total, "cost_complete": all(isinstance(c, (int, float)) for c in costs),
            "usd_per_m_kept_rows": total / kept * 1e6 if kept else None}


def stage_cost(report: dict[str, Any] | None) -> float | None:
    """What a stage cost: its workers at the worker-hour price, plus its tokens at the token prices when the spec
    has them (an endpoint judge: reports/cost.py token_priced_cost); None without a report."""
    if report is None:
        return None
    cost = report.get("cost") or {}
    priced = cost.get("token_priced") or {}
    return float(cost.get("total_usd") or 0.0) + float(priced.get("total_usd") or 0.0)


def funnel_table(report: dict[str, Any]) -> list[list[str]]:
    """Rows of the funnel table: a header, then one per stage."""
    rows = [["stage", "task", *[label for _, label in FUNNEL_COLUMNS], "cost"]]
    for stage in report["stages"]:
        cost = stage_cost(stage["report"])
        rows.append([stage["name"], stage["task"], *[str(stage["funnel"][k]) for k, _ in FUNNEL_COLUMNS],
                     fmt_usd(cost)])
    return rows


def summary_line(report: dict[str, Any]) -> str:
    per_m = report["usd_per_m_kept_rows"]
    state = "finished" if report["finished"] else "NOT finished"
    return (f"pipeline {report['pipeline']} ({state}): {report['rows_in']} rows in, {report['rows_kept']} kept; "
            f"total {fmt_usd(report['total_usd'])}" + (f" = {fmt_usd(per_m)} / M kept rows" if per_m is not None
                                                       else ""))


def render_pipeline_text(report: dict[str, Any]) -> str:
    """The summary, the funnel as an aligned table, the first filter errors, then the stages side by side."""
    rows = funnel_table(report)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    lines = [summary_line(report), "", "[funnel]", *table, *_filter_errors(report), ""]
    reports = [s["report"] for s in report["stages"] if s["report"] is not None]
    lines += [f"stage {s['name']}: {s['not_reported']}" for s in report["stages"] if s["report"] is None]
    return "\n".join(lines) + "\n" + (render_text(reports) if reports else "")


def render_pipeline_json(report: dict[str, Any]) -> str:
    """The pipeline report as JSON (each stage's report as `jobrunner report` gives it for that stage)."""
    stages = [{**s, "report": json.loads(render_json([s["report"]])) if s["report"] else None}
              for s in report["stages"]]
    return json.dumps({**report, "stages": stages}, indent=2, default=str) + "\n"


def render_pipeline_html(report: dict[str, Any]) -> str:
    """The stages' report page (side by side) with the pipeline's summary, funnel table and chart on top."""
    reports = [s["report"] for s in report["stages"] if s["report"] is not None]
    title = f"jobrunner pipeline: {report['pipeline']}"
    section = _pipeline_section(report)
    if not reports:
        return f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{escape(title)}</title>" \
               f"</head><body>{section}</body></html>\n"
    page = render_html(reports)
    head, _, body = page.partition("<body>")
    head = head.replace("<title>", f"<title>{escape(title)} — ", 1)
    return f"{head}<body>{section}<h2>Stages side by side</h2>{body}"


def _pipeline_section(report: dict[str, Any]) -> str:
    per_m = report["usd_per_m_kept_rows"]
    cards = [("stages", str(len(report["stages"]))), ("rows in", str(report["rows_in"])),
             ("kept rows", str(report["rows_kept"])), ("total cost", fmt_usd(report["total_usd"])),
             ("$ / M kept rows", fmt_usd(per_m) if per_m is not None else "n/a")]
    rows = funnel_table(report)
    table = "<table><tr>" + "".join(f"<th>{escape(c)}</th>" for c in rows[0]) + "</tr>" + "".join(
        "<tr>" + "".join(f"<td{'' if i < 2 else ' class=num'}>{escape(c)}</td>" for i, c in enumerate(r)) + "</tr>"
        for r in rows[1:]) + "</table>"
    errors = "".join(f"<li><code>{escape(e)}</code></li>" for e in _filter_errors(report)[1:])
    state = "finished" if report["finished"] else "NOT finished"
    return (f"<h1>{escape('jobrunner pipeline: ' + str(report['pipeline']))}</h1><div class=\"sub\">"
            f"{escape(report['url'])} — {state}</div><div class=\"cards\">"
            + "".join(f'<div class="card"><div class="v">{escape(v)}</div><div class="k">{escape(k)}</div></div>'
                      for k, v in cards)
            + "</div><h2>Funnel</h2>" + table + _funnel_chart(report)
            + (f"<p>First filter errors:</p><ul>{errors}</ul>" if errors else ""))


def _funnel_chart(report: dict[str, Any]) -> str:
    """Horizontal bars per stage: kept, dropped by filter, filter errors, error rows (widths to the largest)."""
    colours = {"kept": "#2e7d32", "dropped": "#f9a825", "filter_error": "#ef6c00", "error": "#c62828"}
    largest = max([s["funnel"]["rows_in"] for s in report["stages"]] + [1])
    width, bar_h, left = 560, 22, 110
    bars = []
    for i, stage in enumerate(report["stages"]):
        y, x = 24 + i * (bar_h + 10), left
        bars.append(f'<text class="tick" x="4" y="{y + 15}">{escape(stage["name"])}</text>')
        for key, colour in colours.items():
            n = stage["funnel"][key]
            w = width * n / largest
            if w > 0:
                bars.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{colour}">'
                            f"<title>{escape(stage['name'])}: {n} {key}</title></rect>")
            x += w
        bars.append(f'<text class="bar-value" x="{x + 6:.1f}" y="{y + 15}">{stage["funnel"]["kept"]} of '
                    f'{stage["funnel"]["rows_in"]} kept</text>')
    legend = "".join(f'<rect x="{left + i * 120}" y="4" width="10" height="10" fill="{c}"/><text class="legend" '
                     f'x="{left + i * 120 + 14}" y="13">{k.replace("_", " ")}</text>' for i, (k, c) in
                     enumerate(colours.items()))
    height = 34 + len(report["stages"]) * (bar_h + 10)
    return (f'<svg class="chart" width="{left + width + 140}" height="{height}" role="img" '
            f'aria-label="pipeline funnel">{legend}{"".join(bars)}</svg>')


def _filter_errors(report: dict[str, Any]) -> list[str]:
    examples = [e for s in report["stages"] for e in s["funnel"].get("filter_error_examples") or []]
    return ["first filter errors:", *examples] if examples else []


def write_pipeline_report(url: str, storage_options: dict | None = None,
                          worker_hour_usd: float | None = None) -> dict[str, Any]:
    """Each stage's `_report/` and the pipeline's own (`<output>/_report/report.json`, `.html`); never raises (a
    report problem is returned as {"error": ...}, as write_job_report does)."""
    from jobrunner.io.layout import REPORT_FILES
    from jobrunner.io.report_reader import write_report_files
    from jobrunner.redaction import redact_text
    from jobrunner.reports.job import write_job_report

    try:
        record = read_pipeline(Storage(url, storage_options)) or {}
        for stage in record.get("stages", []):
            write_job_report(f"{url.rstrip('/')}/{stage['url']}", storage_options, worker_hour_usd)
        report = load_pipeline_report(url, storage_options, worker_hour_usd)
        json_key, html_key = REPORT_FILES
        paths = write_report_files(url, {json_key: render_pipeline_json(report),
                                         html_key: render_pipeline_html(report)}, storage_options)
    except Exception as exc:  # noqa: BLE001 - a report must never fail the job
        return {"error": redact_text(f"{type(exc).__name__}: {exc}")}
    report["files"] = paths
    return report
