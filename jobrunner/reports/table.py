"""The figures of a report as labelled table rows: one value column per run, ratios against the first.

Every renderer (text, markdown, HTML) draws from `figure_rows`, so the three show the same figures, formatted
the same way; a missing figure (None) prints as "n/a", never as NaN or inf.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from jobrunner.reports.accumulators import QUANTILES
from jobrunner.reports.cost import ratio

Formatter = Callable[[object], str]
NA = "n/a"


def fmt_int(value: object) -> str:
    """12,345."""
    return NA if not _is_number(value) else f"{int(value):,}"


def fmt_float(value: object, digits: int = 1) -> str:
    """12,345.6 (`digits` decimals)."""
    return NA if not _is_number(value) else f"{float(value):,.{digits}f}"


def fmt_pct(value: object) -> str:
    """A share in [0, 1] as 12.3%."""
    return NA if not _is_number(value) else f"{100.0 * float(value):.1f}%"


def fmt_seconds(value: object) -> str:
    """Seconds with a unit that keeps 3 significant digits: 77.3 µs, 850 ms, 1.25 s."""
    if not _is_number(value):
        return NA
    seconds = float(value)
    if seconds == 0:
        return "0 s"
    if abs(seconds) < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if abs(seconds) < 0.9995:  # 999.6 ms would print as "1e+03 ms"
        return f"{seconds * 1000:.3g} ms"
    return f"{seconds:,.3g} s" if seconds < 1000 else f"{seconds:,.0f} s"


def fmt_usd(value: object) -> str:
    """Dollars, never with an exponent: cents from $1 ($1.50), else 4 significant digits ($0.00009708)."""
    if not _is_number(value):
        return NA
    amount = float(value)
    if amount >= 1:
        return f"${amount:,.2f}"
    if amount <= 0:
        return "$0"
    decimals = min(12, 3 - math.floor(math.log10(amount)))
    return f"${amount:.{decimals}f}"


def fmt_text(value: object) -> str:
    """Any value as text; None as n/a."""
    return NA if value is None or value == "" else str(value)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Figure:
    """One row of the table: where to find it in a report, how to print it, which direction is better."""

    section: str
    label: str
    path: tuple[str, ...]
    fmt: Formatter
    compare: bool = True  # show a ratio against the first run

    def value(self, report: dict) -> object:
        """The raw value in `report`, or None."""
        value: object = report
        for key in self.path:
            value = value.get(key) if isinstance(value, dict) else None
        return value


def _latency_figures() -> list[Figure]:
    names = {"ttft_s": "TTFT", "itl_mean_s": "inter-token latency", "e2e_s": "end-to-end",
             "queue_s": "queue time"}
    return [Figure("latency", f"{title} {q}", ("latency_s", name, q), fmt_seconds)
            for name, title in names.items() for q in (*QUANTILES, "max")]


FIGURES: list[Figure] = [
    Figure("run", "model", ("run", "model", "source"), fmt_text, False),
    Figure("run", "quantization", ("run", "model", "quantization"), fmt_text, False),
    Figure("run", "dtype", ("run", "model", "dtype"), fmt_text, False),
    Figure("run", "engine", ("run", "model", "engine"), fmt_text, False),
    Figure("run", "dtype chosen", ("run", "model", "dtype_reason"), fmt_text, False),
    Figure("run", "date", ("run", "date"), fmt_text, False),
    Figure("run", "hardware", ("run", "hardware", "summary"), fmt_text, False),
    Figure("run", "jobrunner version", ("run", "jobrunner_version"), fmt_text, False),
    Figure("rows", "rows", ("rows", "total"), fmt_int),
    Figure("rows", "errors", ("rows", "errors"), fmt_int),
    Figure("rows", "error rate", ("rows", "error_rate"), fmt_pct),
    Figure("rows", "stopped at max_tokens (finish_reason length)", ("rows", "stopped_at_max_tokens"), fmt_int),
    Figure("rows", "share stopped at max_tokens", ("rows", "stopped_at_max_tokens_rate"), fmt_pct),
    Figure("tokens", "input tokens", ("tokens", "input"), fmt_int),
    Figure("tokens", "cached input tokens", ("tokens", "cached"), fmt_int),
    Figure("tokens", "output tokens", ("tokens", "output"), fmt_int),
    Figure("tokens", "prefix-cache hit rate", ("tokens", "prefix_cache_hit_rate"), fmt_pct),
    Figure("tokens", "ideal prefix-cache hit rate (each shared prefix computed once)",
           ("tokens", "ideal_prefix_cache_hit_rate"), fmt_pct),
    Figure("tokens", "prefix-cache hits, share of the ideal", ("tokens", "prefix_cache_of_ideal"), fmt_pct),
    Figure("time", "wall time", ("time", "wall_s"), fmt_seconds),
    Figure("time", "workers", ("time", "num_workers"), fmt_int),
    Figure("time", "worker-seconds", ("time", "worker_seconds"), fmt_float),
    Figure("time", "of which start-up (actor start + model load)", ("time", "startup_seconds"), fmt_float),
    Figure("time", "of which paid for work later redone / lost", ("time", "lost_worker_seconds"), fmt_float),
    Figure("time", "runs (interrupted, failed and killed ones included)", ("time", "num_runs"), fmt_int, False),
    Figure("time", "last run: planning", ("time", "plan_s"), fmt_seconds, False),
    Figure("time", "last run: Ray start", ("time", "ray_start_s"), fmt_seconds, False),
    Figure("time", "last run: first worker ready after", ("time", "first_ready_s"), fmt_seconds, False),
    Figure("time", "last run: its first output token after", ("time", "first_token_s"), fmt_seconds, False),
    Figure("time", "engine prefill share", ("cost", "prefill_share"), fmt_pct),
    Figure("throughput", "tokens/s (input + output)", ("throughput", "tokens_per_s"), fmt_float),
    Figure("throughput", "output tokens/s", ("throughput", "output_tokens_per_s"), fmt_float),
    Figure("throughput", "rows/s", ("throughput", "rows_per_s"), lambda v: fmt_float(v, 2)),
    Figure("throughput", "tokens/s per worker", ("throughput", "tokens_per_worker_s"), fmt_float),
    Figure("throughput", "output tokens/s per worker", ("throughput", "output_tokens_per_worker_s"),
           fmt_float),
    Figure("throughput", "rows/s per worker", ("throughput", "rows_per_worker_s"), lambda v: fmt_float(v, 2)),
    *_latency_figures(),
    Figure("cost", "price per worker-hour", ("cost", "worker_hour_usd"), fmt_usd),
    Figure("cost", "job cost", ("cost", "total_usd"), fmt_usd),
    Figure("cost", "of which start-up", ("cost", "startup_usd"), fmt_usd),
    Figure("cost", "of which paid for work later redone / lost", ("cost", "lost_usd"), fmt_usd),
    Figure("cost", "$ / M input tokens", ("cost", "usd_per_m_input"), fmt_usd),
    Figure("cost", "$ / M output tokens", ("cost", "usd_per_m_output"), fmt_usd),
    Figure("cost", "$ / M tokens (blended)", ("cost", "usd_per_m_total"), fmt_usd),
    Figure("cost", "steady state: $ / M input tokens (start-up, redone work excluded)",
           ("cost", "steady_state", "usd_per_m_input"), fmt_usd),
    Figure("cost", "steady state: $ / M output tokens", ("cost", "steady_state", "usd_per_m_output"), fmt_usd),
    Figure("cost", "steady state: $ / M tokens (blended)", ("cost", "steady_state", "usd_per_m_total"), fmt_usd),
]

# Only when some run has token prices (cost.usd_per_m_input / output: an endpoint's price list).
TOKEN_PRICE_FIGURES: list[Figure] = [
    Figure("cost", "token prices: $ / M input tokens", ("cost", "token_priced", "usd_per_m_input"), fmt_usd),
    Figure("cost", "token prices: $ / M output tokens", ("cost", "token_priced", "usd_per_m_output"), fmt_usd),
    Figure("cost", "token-priced cost of the output's rows", ("cost", "token_priced", "total_usd"), fmt_usd),
    Figure("cost", "token-priced $ / M tokens (blended)", ("cost", "token_priced", "usd_per_m_total"), fmt_usd),
    Figure("cost", "spent at the token prices (every request sent)", ("cost", "token_priced", "spent_usd"),
           fmt_usd),
]

GOODPUT_FIGURES: list[Figure] = [
    Figure("goodput", "SLO TTFT", ("goodput", "slo_ttft_s"), fmt_seconds, False),
    Figure("goodput", "SLO end-to-end", ("goodput", "slo_e2e_s"), fmt_seconds, False),
    Figure("goodput", "rows meeting SLO", ("goodput", "row_share"), fmt_pct),
    Figure("goodput", "output tokens meeting SLO", ("goodput", "output_token_share"), fmt_pct),
    Figure("goodput", "$ / M good output tokens", ("goodput", "cost", "usd_per_m_output"), fmt_usd),
    Figure("goodput", "$ / M good tokens (blended)", ("goodput", "cost", "usd_per_m_total"), fmt_usd),
]


JSON_FIGURES: list[Figure] = [
    Figure("rows", "rows checked against a JSON schema", ("rows", "json_checked"), fmt_int),
    Figure("rows", "not schema-valid JSON", ("rows", "json_invalid"), fmt_int),
    Figure("rows", "schema-valid JSON share", ("rows", "json_valid_rate"), fmt_pct),
]


# Only when some run is an embed / score job (prefill only): what it computed and its input throughput.
TENSOR_PARALLEL_FIGURES: list[Figure] = [  # when some run split its model over ranks
    Figure("run", "tensor parallel size", ("run", "tensor_parallel", "tensor_parallel_size"), fmt_int, False),
    Figure("run", "weights per rank (bytes)", ("run", "tensor_parallel", "rank_weights_bytes"), fmt_int),
    Figure("run", "KV cache per rank (bytes)", ("run", "tensor_parallel", "rank_kv_bytes"), fmt_int),
    Figure("run", "tensor-parallel ranks", ("run", "tensor_parallel", "ranks_text"), fmt_text, False),
]

TASK_FIGURES: list[Figure] = [
    Figure("run", "task", ("run", "task", "kind"), fmt_text, False),
    Figure("run", "pooling", ("run", "task", "pooling"), fmt_text, False),
    Figure("run", "embedding dimension", ("run", "task", "embedding_dim"), fmt_int, False),
    Figure("throughput", "input tokens/s", ("throughput", "input_tokens_per_s"), fmt_float),
    Figure("throughput", "input tokens/s per worker", ("throughput", "input_tokens_per_worker_s"), fmt_float),
]


def finish_reasons_line(report: dict) -> str:
    """"finish reasons: stop 60, length 4" (most frequent first)."""
    reasons = sorted(report["rows"]["finish_reasons"].items(), key=lambda kv: (-kv[1], kv[0]))
    return "finish reasons: " + ", ".join(f"{reason} {count:,}" for reason, count in reasons)


REASONING_FIGURES: list[Figure] = [
    Figure("tokens", "of the output: reasoning tokens", ("tokens", "reasoning"), fmt_int),
    Figure("tokens", "of the output: answer tokens", ("tokens", "answer"), fmt_int),
    Figure("cost", "of the output cost: reasoning", ("cost", "reasoning_usd"), fmt_usd),
    Figure("cost", "$ / M answer tokens (their reasoning paid)", ("cost", "usd_per_m_answer"), fmt_usd),
]


IMAGE_FIGURES: list[Figure] = [  # when some run's rows can carry images (reports/images.py)
    Figure("rows", "images", ("images", "total"), fmt_int),
    Figure("rows", "rows with images", ("images", "rows_with_images"), fmt_int),
    Figure("rows", "images per row", ("images", "per_row"), fmt_float),
    Figure("rows", "most images in a row", ("images", "max_per_row"), fmt_int),
    Figure("tokens", "of the input: text tokens", ("tokens", "text_input"), fmt_int),
    Figure("tokens", "of the input: image tokens", ("tokens", "image_input"), fmt_int),
    Figure("tokens", "image tokens per image", ("images", "tokens_per_image"), fmt_float),
    Figure("cost", "of the input cost: text", ("cost", "text_input_usd"), fmt_usd),
    Figure("cost", "of the input cost: images", ("cost", "image_input_usd"), fmt_usd),
    Figure("cost", "$ / image (its input tokens)", ("cost", "usd_per_image"), fmt_usd),
]
IMAGE_PRICE_FIGURES: list[Figure] = [
    Figure("cost", "token prices: image input cost", ("cost", "token_priced", "image_input_usd"), fmt_usd),
    Figure("cost", "token prices: $ / image", ("cost", "token_priced", "usd_per_image"), fmt_usd),
]


def figures_for(reports: list[dict]) -> list[Figure]:
    """The figures to show: goodput rows only when some run has SLO targets, JSON validity only when some run
    had rows with a JSON schema (its rows after the other row figures)."""
    has_goodput = any(report.get("goodput") for report in reports)
    figures = list(FIGURES)
    if any((report.get("rows") or {}).get("json_checked") for report in reports):
        _insert_after_section(figures, "rows", JSON_FIGURES)
    if any(((report.get("run") or {}).get("task") or {}).get("kind") for report in reports):
        _insert_after_section(figures, "run", TASK_FIGURES[:3])
        _insert_after_section(figures, "throughput", TASK_FIGURES[3:])
    if any((report.get("run") or {}).get("tensor_parallel") for report in reports):
        _insert_after_section(figures, "run", TENSOR_PARALLEL_FIGURES)
    if any((report.get("tokens") or {}).get("reasoning") for report in reports):
        _insert_after_section(figures, "tokens", REASONING_FIGURES[:2])
        _insert_after_section(figures, "cost", REASONING_FIGURES[2:])
    if any((report.get("cost") or {}).get("token_priced") for report in reports):
        _insert_after_section(figures, "cost", TOKEN_PRICE_FIGURES)
    if any(report.get("images") for report in reports):
        for section in ("rows", "tokens", "cost"):
            _insert_after_section(figures, section, [f for f in IMAGE_FIGURES if f.section == section])
        if any((report.get("cost") or {}).get("token_priced") for report in reports):
            _insert_after_section(figures, "cost", IMAGE_PRICE_FIGURES)
    return figures + (GOODPUT_FIGURES if has_goodput else [])


def _insert_after_section(figures: list[Figure], section: str, extra: list[Figure]) -> None:
    last = max(i for i, f in enumerate(figures) if f.section == section)
    figures[last + 1:last + 1] = extra


def figure_rows(reports: list[dict]) -> list[tuple[Figure, list[str]]]:
    """(figure, a cell per run); cells after the first carry the ratio to the first run: "12.0 (0.50x)"."""
    rows = []
    for figure in figures_for(reports):
        values = [figure.value(report) for report in reports]
        cells = [figure.fmt(v) for v in values]
        if figure.compare and len(reports) > 1:
            pairs = zip(cells[1:], values[1:], strict=True)
            cells = [cells[0]] + [_with_ratio(cell, value, values[0]) for cell, value in pairs]
        rows.append((figure, cells))
    return rows


def _with_ratio(cell: str, value: object, baseline: object) -> str:
    if not (_is_number(value) and _is_number(baseline)):
        return cell
    factor = ratio(float(value), float(baseline))
    return cell if factor is None else f"{cell} ({factor:.2f}x)"


def run_labels(reports: list[dict]) -> list[str]:
    """A distinct column title per run: its --label, else the job name plus what tells same-named runs apart
    (quantization, else the output folder's name, else the run date), else "#2", "#3"."""
    labels = [str(r.get("run", {}).get("label") or f"run {i + 1}") for i, r in enumerate(reports)]
    if len(set(labels)) < len(labels) and not all(r.get("run", {}).get("label_source") for r in reports):
        labels = _disambiguate(labels, reports)
    seen: dict[str, int] = {}
    unique: list[str] = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        unique.append(label if seen[label] == 1 else f"{label} #{seen[label]}")
    return unique


def _disambiguate(labels: list[str], reports: list[dict]) -> list[str]:
    runs = [r.get("run", {}) for r in reports]
    for detail in (lambda run: (run.get("model") or {}).get("quantization"),
                   lambda run: str(run.get("url") or "").rstrip("/").rsplit("/", 1)[-1] or None,
                   lambda run: run.get("date")):
        values = [detail(run) for run in runs]
        if all(values) and len(set(zip(labels, values, strict=True))) == len(labels):
            return [label if run.get("label_source") else f"{label} [{value}]"
                    for label, value, run in zip(labels, values, runs, strict=True)]
    return labels
