"""The report's charts (latency CDFs, tokens/s over job time, $ per million tokens per run) as inline SVG."""

from __future__ import annotations

from collections.abc import Callable

from jobrunner.reports.svg import PALETTE, Band, Series, bar_chart, empty_chart, line_chart, nice_ticks
from jobrunner.reports.table import fmt_float, fmt_seconds, fmt_usd, run_labels

NO_ROWS = "0 rows: nothing to chart (the run had nothing to do, or nothing committed)"
LATENCY_TITLES = {"ttft_s": "Time to first token", "itl_mean_s": "Inter-token latency (row mean)",
                  "e2e_s": "End-to-end latency", "queue_s": "Queue time"}


def latency_cdf_chart(reports: list[dict], name: str) -> str:
    """CDF of one latency per run; the x axis ends at the largest p99 so the body of the curve is readable."""
    title = f"{LATENCY_TITLES[name]}: CDF"
    labels = run_labels(reports)
    series = []
    for i, (label, report) in enumerate(zip(labels, reports, strict=True)):
        cdf = report["charts"]["latency_cdf"][name]
        series.append(Series(label, cdf["x"], cdf["p"], PALETTE[i % len(PALETTE)]))
    p99s = [r["latency_s"][name]["p99"] for r in reports if r["latency_s"][name]["p99"] is not None]
    if not p99s or max(p99s) <= 0:
        return empty_chart(title, NO_ROWS if _no_rows(reports) else "no latency recorded (every row failed?)")
    unit, x_fmt = time_axis(max(p99s))
    return line_chart(title, series, f"{unit} (axis ends at the largest p99)", "rows at or below",
                      x_fmt, lambda p: f"{p * 100:.0f}%", x_max=max(p99s), y_max=1.0)


def tokens_over_time_chart(reports: list[dict], which: str) -> str:
    """`which`: "output" or "input" tokens per second over the job's wall time, one line per run, with the
    run's headline average (over its whole wall time) dashed and its start-up (before the first row reached
    an engine: placing workers, loading the model) shaded."""
    title = f"{which.capitalize()} tokens/s over job time"
    series, bands = [], []
    for i, (label, report) in enumerate(zip(run_labels(reports), reports, strict=True)):
        color = PALETTE[i % len(PALETTE)]
        data = report["charts"][f"{which}_tokens_per_s"]
        series.append(Series(label, data["t"], data["tokens_per_s"], color))
        average, wall = report["throughput"].get(f"{which}_tokens_per_s"), report["time"]["wall_s"]
        if average and wall:
            series.append(Series(f"{label}: average {fmt_float(average, 0)}", [0.0, wall], [average, average],
                                 color, dashed=True))
        startup = report["run"].get("startup_end_s")
        if startup:
            name = "start-up" if len(reports) == 1 else f"{label}: start-up"
            bands.append(Band(0.0, startup, f"{name} {fmt_seconds(startup)}", color))
    if not any(any(v > 0 for v in s.ys) for s in series):
        return empty_chart(title, NO_ROWS if _no_rows(reports) else f"no {which} tokens")
    walls = [r["time"]["wall_s"] for r in reports if r["time"]["wall_s"]]
    unit, x_fmt = time_axis(max(walls) if walls else max(max(s.xs, default=0.0) for s in series))
    return line_chart(title, series, f"{unit} since job start", "tokens/s", x_fmt,
                      lambda v: fmt_float(v, 0), x_max=max(walls) if walls else None, bands=bands)


def cost_chart(reports: list[dict]) -> str:
    """$ per million input, output and blended tokens, a block of bars per run."""
    title = "Cost: $ per million tokens"
    bars = [(label, [r["cost"][key] for r in reports], color) for label, key, color in (
        ("input", "usd_per_m_input", PALETTE[0]), ("output", "usd_per_m_output", PALETTE[1]),
        ("blended", "usd_per_m_total", PALETTE[2]))]
    bars = [bar for bar in bars if any(value is not None for value in bar[1])]  # e.g. no input/output split
    if not bars:
        return empty_chart(title, NO_ROWS if _no_rows(reports) else
                           "no cost: give --worker-hour-usd (or cost.worker_hour_usd in the spec)")
    return bar_chart(title, run_labels(reports), bars, fmt_usd)


def _no_rows(reports: list[dict]) -> bool:
    """Whether no run has a row (a night with nothing to do): every chart is empty for that reason."""
    return all(not (r.get("rows") or {}).get("total") for r in reports)


def time_axis(high_s: float) -> tuple[str, Callable[[float], str]]:
    """One unit for a whole time axis ending near `high_s` seconds: milliseconds when its last tick is below
    1 s, else seconds; the unit is the axis label's, and the ticks are plain numbers in it."""
    scale, unit = (1000.0, "milliseconds") if nice_ticks(high_s)[-1] < 1 else (1.0, "seconds")
    return unit, lambda value: format(round(value * scale, 9), ",.6g")


def all_charts(reports: list[dict]) -> list[str]:
    """Every chart of the page, in reading order."""
    return ([cost_chart(reports), tokens_over_time_chart(reports, "output"),
             tokens_over_time_chart(reports, "input")]
            + [latency_cdf_chart(reports, name) for name in LATENCY_TITLES])
