"""Plain-text, markdown and JSON renderings of one or several reports."""

from __future__ import annotations

import json
import math

from jobrunner.reports.compare import fmt_value, spec_differences
from jobrunner.reports.table import figure_rows, finish_reasons_line, run_labels


def render_json(reports: list[dict]) -> str:
    """One report as itself; several as {"runs": [...], "baseline": first label}. Never NaN."""
    document = reports[0] if len(reports) == 1 else {"runs": reports, "baseline": run_labels(reports)[0],
                                                     "spec_differences": spec_differences(reports)}
    return json.dumps(_finite(document), indent=2, allow_nan=False, default=str) + "\n"


def _finite(value: object) -> object:
    """The same structure with every NaN / infinity (e.g. copied from an odd manifest) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def render_text(reports: list[dict]) -> str:
    """An aligned table (a column per run), then errors by kind, cost notes and warnings."""
    header = ["", *run_labels(reports)]
    body = []
    section = None
    for figure, cells in figure_rows(reports):
        if figure.section != section:
            section = figure.section
            body.append([f"[{section}]", *[""] * len(reports)])
        body.append([f"  {figure.label}", *cells])
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                       enumerate(zip(row, widths, strict=True))).rstrip() for row in [header, *body]]
    return "\n".join(lines + _differences(reports, "  - ") + _notes(reports, bullet="  - ")) + "\n"


def render_markdown(reports: list[dict]) -> str:
    """A markdown table (a column per run), then errors by kind, cost notes and warnings."""
    labels = run_labels(reports)
    lines = ["# jobrunner report", "", "| figure | " + " | ".join(labels) + " |",
             "|---|" + "---:|" * len(labels)]
    for figure, cells in figure_rows(reports):
        lines.append(f"| {figure.section}: {figure.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines + _differences(reports, "- ") + _notes(reports, bullet="- ")) + "\n"


def _notes(reports: list[dict], bullet: str) -> list[str]:
    lines = []
    for label, report in zip(run_labels(reports), reports, strict=True):
        items = [f"error {kind}: {count:,} rows" for kind, count in report["rows"]["errors_by_kind"].items()]
        items += [finish_reasons_line(report)] if report["rows"].get("finish_reasons") else []
        items += [dedupe_line(report["dedupe"])] if report.get("dedupe") else []
        items += [_adapter_line(name, figures) for name, figures in (report.get("adapters") or {}).items()]
        items += [f"cost: {note}" for note in report["cost"]["notes"]]
        items += [f"warning: {warning}" for warning in report["warnings"]]
        if items:
            lines += ["", f"{label}:"] + [bullet + item for item in items]
    return lines


def dedupe_line(dedupe: dict) -> str:
    """``output.dedupe``'s counts: ``dedupe prompts: 5 of 10 rows repeat an earlier row's prompt (5 distinct),
    not generated`` or ``dedupe outputs: 6 of 8 samples repeat an earlier sample's text (2 distinct)``."""
    if dedupe.get("mode") == "outputs":
        return (f"dedupe outputs: {dedupe.get('duplicate_outputs', 0):,} of {dedupe.get('samples', 0):,} samples "
                f"repeat an earlier sample's text ({dedupe.get('distinct_outputs', 0):,} distinct)")
    return (f"dedupe prompts: {dedupe.get('duplicate_prompts', 0):,} of {dedupe.get('rows', 0):,} rows repeat an "
            f"earlier row's prompt ({dedupe.get('distinct_prompts', 0):,} distinct), not generated")


def _adapter_line(name: str, figures: dict) -> str:
    """One adapter's rows and tokens, e.g. ``adapter sql: 120 rows (1 error), 9,600 input / 3,840 output tokens``."""
    errors = f" ({figures['errors']:,} errors)" if figures["errors"] else ""
    return (f"adapter {name}: {figures['rows']:,} rows{errors}, {figures['input_tokens']:,} input "
            f"({figures['cached_tokens']:,} cached) / {figures['output_tokens']:,} output tokens")


def _differences(reports: list[dict], bullet: str) -> list[str]:
    """"spec differences:" and a line per differing spec field (runs compared only)."""
    differences = spec_differences(reports)
    if len(reports) < 2:
        return []
    if not differences:
        return ["", "spec differences: none (apart from output.url)"]
    labels = run_labels(reports)
    return ["", "spec differences:"] + [
        bullet + f"{key}: " + ", ".join(f"{label}={fmt_value(v)}" for label, v in zip(labels, values, strict=True))
        for key, values in differences.items()]
