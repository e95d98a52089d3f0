"""What tells compared runs apart: user labels, and the job-spec fields whose values differ between runs."""

from __future__ import annotations

import json
from typing import Any

# Differ on every run and say nothing about the workload or its settings.
IGNORED_SPEC_KEYS = ("output.url", "name")


def apply_labels(reports: list[dict], labels: list[str]) -> None:
    """Set the first len(labels) runs' labels (`report --label`); ValueError when there are more labels."""
    if len(labels) > len(reports):
        raise ValueError(f"{len(labels)} --label values for {len(reports)} output(s): give at most one per output")
    for report, label in zip(reports, labels, strict=False):
        report["run"]["label"] = label
        report["run"]["label_source"] = "--label"


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and scalars are leaves."""
    if not isinstance(value, dict):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return out


def spec_differences(reports: list[dict]) -> dict[str, list[Any]]:
    """spec key -> one value per run, for the keys whose values differ (plus the dtype each run loaded)."""
    if len(reports) < 2:
        return {}
    flat = [flatten(r["run"].get("spec") or {}) for r in reports]
    for view, report in zip(flat, reports, strict=True):
        view["model.dtype (loaded)"] = report["run"]["model"].get("dtype")
        view["model.quantization (loaded)"] = report["run"]["model"].get("quantization")
    keys = sorted(set().union(*flat) - set(IGNORED_SPEC_KEYS))
    return {key: [view.get(key) for view in flat] for key in keys
            if len({json.dumps(view.get(key), sort_keys=True, default=str) for view in flat}) > 1}


def fmt_value(value: Any) -> str:
    """A spec value for a table cell (absent: '-')."""
    if value is None:
        return "-"
    return value if isinstance(value, str) else json.dumps(value, default=str)
