"""The report as one self-contained HTML page: key figures, inline SVG charts, the full table. No script."""

from __future__ import annotations

from html import escape

from jobrunner.reports.charts import all_charts
from jobrunner.reports.compare import fmt_value, spec_differences
from jobrunner.reports.table import (
    figure_rows,
    finish_reasons_line,
    fmt_float,
    fmt_pct,
    fmt_seconds,
    fmt_text,
    fmt_usd,
    run_labels,
)

STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#1d1d1f;
     background:#fff;max-width:1320px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 10px}
.sub{color:#555;font-size:13px;margin-bottom:16px}
.cards{display:flex;flex-wrap:wrap;gap:12px}
.card{border:1px solid #ddd;border-radius:8px;padding:8px 10px;flex:1 1 0;min-width:0}
.card .v{font-size:16px;font-weight:600;white-space:nowrap} .card .k{font-size:12px;color:#555}
.charts{display:flex;flex-wrap:wrap;gap:16px}
svg.chart{border:1px solid #e3e3e3;border-radius:6px;background:#fff}
.chart-title{font-size:14px;font-weight:600} .tick,.legend,.bar-value,.group{font-size:11px;fill:#333}
.axis-label{font-size:12px;fill:#333} .grid{stroke:#eee} .plot-frame{fill:none;stroke:#bbb}
.empty{font-size:13px;fill:#888}
table{border-collapse:collapse;font-size:13px} td,th{padding:3px 10px;border-bottom:1px solid #eee}
td.num{text-align:right;font-variant-numeric:tabular-nums} th{text-align:right;background:#f6f6f6}
th:first-child,td:first-child{text-align:left} tr.section td{font-weight:600;background:#fafafa}
.warn{color:#8a4b00} code{background:#f3f3f3;padding:1px 4px;border-radius:3px}
.run-cards{margin:8px 0 14px} .run-cards .who{font-size:13px;font-weight:600;margin:0 0 6px}
.band-label{font-size:11px;fill:#555} table.grid th.run{text-align:center}
"""


def render_html(reports: list[dict]) -> str:
    """The whole page for one run or several side by side (ratios against the first)."""
    labels = run_labels(reports)
    title = "jobrunner report: " + (labels[0] if len(labels) == 1 else " vs ".join(labels))
    parts = [f"<h1>{escape(title)}</h1>", _runs_line(reports, labels),
             *[_cards(report, label if len(labels) > 1 else "") for label, report in zip(labels, reports, strict=True)],
             _spec_differences(reports, labels), "<h2>Latency percentiles</h2>", _percentile_grid(reports, labels),
             "<h2>Charts</h2>", '<div class="charts">' + "".join(all_charts(reports)) + "</div>",
             "<h2>All figures</h2>", _table(reports, labels), _notes(reports, labels), _formula()]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>"
            + "\n".join(parts) + "</body></html>\n")


def _runs_line(reports: list[dict], labels: list[str]) -> str:
    items = []
    for label, report in zip(labels, reports, strict=True):
        run = report["run"]
        state = "complete" if run["complete"] else "NOT complete"
        hardware = fmt_text((run.get("hardware") or {}).get("summary"))
        items.append(f"<b>{escape(label)}</b>: <code>{escape(str(run['url']))}</code> "
                     f"({escape(str(run['model']['source']))}, dtype {escape(fmt_text(run['model'].get('dtype')))}, "
                     f"quantization {escape(str(run['model']['quantization']))}{_split(run)}, {state})<br>"
                     f"&nbsp;&nbsp;run {escape(fmt_text(run.get('started_at')))} on {escape(hardware)}, "
                     f"jobrunner {escape(fmt_text(run.get('jobrunner_version')))}")
    return '<div class="sub">' + "<br>".join(items) + "</div>"


def _split(run: dict) -> str:
    """', tensor parallel 2' for a model split over ranks (the figures table has the bytes per rank)."""
    split = run.get("tensor_parallel")
    return f", tensor parallel {int(split['tensor_parallel_size'])}" if isinstance(split, dict) else ""


def _cards(report: dict, label: str) -> str:
    """The headline tiles of one run (a row per run when runs are compared)."""
    figures = [
        ("job cost", fmt_usd(report["cost"]["total_usd"])),
        ("wall time", fmt_seconds(report["time"]["wall_s"])),
        ("$ / M tokens (blended)", fmt_usd(report["cost"]["usd_per_m_total"])),
        ("$ / M output tokens", fmt_usd(report["cost"]["usd_per_m_output"])),
        ("steady state $ / M tokens", fmt_usd((report["cost"].get("steady_state") or {}).get("usd_per_m_total"))),
        ("tokens/s", fmt_float(report["throughput"]["tokens_per_s"])),
        ("output tokens/s", fmt_float(report["throughput"]["output_tokens_per_s"])),
        ("TTFT p50 / p99", f"{fmt_seconds(report['latency_s']['ttft_s']['p50'])} / "
                           f"{fmt_seconds(report['latency_s']['ttft_s']['p99'])}"),
        ("prefix-cache hit rate", fmt_pct(report["tokens"]["prefix_cache_hit_rate"])),
        ("rows (errors)", f"{report['rows']['total']:,} ({report['rows']['errors']:,})"),
    ]
    cards = [f'<div class="card"><div class="v">{escape(v)}</div><div class="k">{escape(k)}</div></div>'
             for k, v in figures]
    who = f'<div class="who">{escape(label)}</div>' if label else ""
    return f'<div class="run-cards">{who}<div class="cards">' + "".join(cards) + "</div></div>"


def _spec_differences(reports: list[dict], labels: list[str]) -> str:
    """The job-spec fields whose values differ between the compared runs."""
    if len(reports) < 2:
        return ""
    differences = spec_differences(reports)
    if not differences:
        return "<h2>Spec differences</h2><p>The runs' job specs are the same (apart from output.url).</p>"
    head = "<tr><th>spec field</th>" + "".join(f"<th>{escape(label)}</th>" for label in labels) + "</tr>"
    rows = [f"<tr><td><code>{escape(key)}</code></td>"
            + "".join(f'<td class="num">{escape(fmt_value(v))}</td>' for v in values) + "</tr>"
            for key, values in differences.items()]
    return '<h2>Spec differences</h2><table class="spec-diff">' + head + "".join(rows) + "</table>"


GRID_LATENCIES = {"ttft_s": "time to first token", "itl_mean_s": "inter-token latency", "e2e_s": "end-to-end",
                  "queue_s": "queue time"}
GRID_QUANTILES = ("p50", "p90", "p99")


def _percentile_grid(reports: list[dict], labels: list[str]) -> str:
    """Latencies down, p50 / p90 / p99 across (a group of three columns per run)."""
    top = "<tr><th></th>" + "".join(f'<th class="run" colspan="3">{escape(label)}</th>' for label in labels) + "</tr>"
    sub = "<tr><th>latency</th>" + "".join(f"<th>{q}</th>" for _ in reports for q in GRID_QUANTILES) + "</tr>"
    rows = [f"<tr><td>{escape(title)}</td>"
            + "".join(f'<td class="num">{escape(fmt_seconds(r["latency_s"][name][q]))}</td>'
                      for r in reports for q in GRID_QUANTILES) + "</tr>"
            for name, title in GRID_LATENCIES.items()]
    return '<table class="grid">' + (top if len(reports) > 1 else "") + sub + "".join(rows) + "</table>"


def _table(reports: list[dict], labels: list[str]) -> str:
    rows = ["<tr><th>figure</th>" + "".join(f"<th>{escape(label)}</th>" for label in labels) + "</tr>"]
    section = None
    for figure, cells in figure_rows(reports):
        if figure.section != section:
            section = figure.section
            rows.append(f'<tr class="section"><td colspan="{len(labels) + 1}">{escape(section)}</td></tr>')
        rows.append(f"<tr><td>{escape(figure.label)}</td>"
                    + "".join(f'<td class="num">{escape(cell)}</td>' for cell in cells) + "</tr>")
    return '<table class="figures">' + "".join(rows) + "</table>"


def _notes(reports: list[dict], labels: list[str]) -> str:
    blocks = []
    for label, report in zip(labels, reports, strict=True):
        items = [f"error kind <b>{escape(kind)}</b>: {count:,} rows"
                 for kind, count in report["rows"]["errors_by_kind"].items()]
        items += [escape(finish_reasons_line(report))] if report["rows"].get("finish_reasons") else []
        items += [f'<span class="warn">cost: {escape(n)}</span>' for n in report["cost"]["notes"]]
        items += [f'<span class="warn">warning: {escape(w)}</span>' for w in report["warnings"]]
        if items:
            listed = "".join(f"<li>{item}</li>" for item in items)
            blocks.append(f"<p><b>{escape(label)}</b></p><ul>{listed}</ul>")
    return ("<h2>Errors and warnings</h2>" + "".join(blocks)) if blocks else ""


def _formula() -> str:
    return ("<h2>How cost is computed</h2><p>cost = worker-seconds &times; price per worker-hour / 3600. "
            "Blended $/M tokens = cost / (input + output tokens) &times; 10<sup>6</sup>. The cost is split "
            "between input and output tokens by the engine's own measure of time spent on prefill vs "
            "decode work (summed over workers, from the manifest): $/M input = cost &times; prefill share / "
            "input tokens &times; 10<sup>6</sup>, $/M output = cost &times; (1 &minus; prefill share) / "
            "output tokens &times; 10<sup>6</sup>. Goodput prices divide the same cost by the tokens of rows "
            "that met the SLO. Worker-seconds are over every run of the job (interrupted and killed ones "
            "included); the steady-state prices leave out start-up and the work paid for and later redone or "
            "lost: the price per token once workers are up.</p>")
