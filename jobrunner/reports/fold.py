"""Fold a stream of metric batches into bounded totals: rows, tokens, errors, latencies, goodput, timeline."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from jobrunner.io.report_reader import LATENCY_COLUMNS, MetricBatch
from jobrunner.reports.accumulators import LatencyValues, TokenTimeline, add_counts, error_kind


@dataclass(frozen=True)
class Slo:
    """Latency targets a row must meet to count as goodput (None: no target on that latency)."""

    ttft_s: float | None = None
    e2e_s: float | None = None

    @property
    def is_set(self) -> bool:
        """Whether any target is given."""
        return self.ttft_s is not None or self.e2e_s is not None


@dataclass
class Folded:
    """Everything a report needs from the rows, in memory bounded by the accumulators."""

    rows: int = 0
    errors: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    good_rows: int = 0
    good_input_tokens: int = 0
    good_output_tokens: int = 0
    max_finish_time_s: float = 0.0
    first_arrival_s: float | None = None  # job time the first row reached an engine: start-up ends here
    error_kind_to_count: dict[str, int] = field(default_factory=dict)
    finish_reason_to_count: dict[str, int] = field(default_factory=dict)
    json_valid_to_count: dict[bool, int] = field(default_factory=dict)  # json_valid true / false (no nulls)
    reasoning_tokens: int | None = None  # None: no part has the num_reasoning_tokens column
    adapter_figures: dict[str, list[int]] | None = None  # adapter -> ADAPTER_FIGURES; None: no adapter column
    image_figures: dict[str, int] | None = None  # io/report_reader.py IMAGE_FIGURES; None: no num_images column
    latencies: dict[str, LatencyValues] = field(
        default_factory=lambda: {name: LatencyValues() for name in LATENCY_COLUMNS})
    input_timeline: TokenTimeline = field(default_factory=TokenTimeline)
    output_timeline: TokenTimeline = field(default_factory=TokenTimeline)


def fold_batches(batches: Iterable[MetricBatch], slo: Slo) -> Folded:
    """Consume every batch once and return the totals."""
    folded = Folded()
    for batch in batches:
        _fold_counts(folded, batch)
        _fold_goodput(folded, batch, slo)
        _fold_timelines(folded, batch)
        for name in LATENCY_COLUMNS:
            folded.latencies[name].add(getattr(batch, name))
    return folded


def _fold_counts(folded: Folded, batch: MetricBatch) -> None:
    errors = int(batch.is_error.sum())
    folded.rows += batch.num_rows
    folded.errors += errors
    folded.input_tokens += int(batch.num_prompt_tokens.sum())
    folded.cached_tokens += int(batch.num_cached_tokens.sum())
    folded.output_tokens += int(batch.num_output_tokens.sum())
    add_counts(folded.error_kind_to_count, batch.error_to_count, error_kind)
    add_counts(folded.finish_reason_to_count, batch.finish_reason_to_count)
    add_counts(folded.json_valid_to_count, batch.json_valid_to_count)
    if batch.num_reasoning_tokens is not None:
        folded.reasoning_tokens = (folded.reasoning_tokens or 0) + batch.num_reasoning_tokens
    if batch.adapter_figures is not None:
        folded.adapter_figures = folded.adapter_figures or {}
        for name, figures in batch.adapter_figures.items():
            total = folded.adapter_figures.setdefault(name, [0] * len(figures))
            total[:] = [a + b for a, b in zip(total, figures, strict=True)]
    if batch.image_figures is not None:
        _fold_images(folded, batch.image_figures)
    finite = batch.finish_time_s[np.isfinite(batch.finish_time_s)]
    if finite.size:
        folded.max_finish_time_s = max(folded.max_finish_time_s, float(finite.max()))
    unexplained = errors - sum(batch.error_to_count.values())
    if unexplained > 0:  # finish_reason "error" with a null error message
        add_counts(folded.error_kind_to_count, {"unknown": unexplained})


def _fold_images(folded: Folded, figures: dict[str, int]) -> None:
    """Sum the image figures (the most images in a row: the largest)."""
    total = folded.image_figures = folded.image_figures or dict.fromkeys(figures, 0)
    for name, value in figures.items():
        total[name] = max(total[name], value) if name == "max_images" else total[name] + value


def _fold_goodput(folded: Folded, batch: MetricBatch, slo: Slo) -> None:
    """A row is good when it did not fail and met every target given (a missing latency fails); without a
    target the report has no goodput block, so nothing is counted."""
    if not slo.is_set:
        return
    good = ~batch.is_error
    with np.errstate(invalid="ignore"):
        if slo.ttft_s is not None:
            good &= batch.ttft_s <= slo.ttft_s
        if slo.e2e_s is not None:
            good &= batch.e2e_s <= slo.e2e_s
    folded.good_rows += int(good.sum())
    folded.good_input_tokens += int(batch.num_prompt_tokens[good].sum())
    folded.good_output_tokens += int(batch.num_output_tokens[good].sum())


def _fold_timelines(folded: Folded, batch: MetricBatch) -> None:
    """Prefill over [arrival + queue, arrival + ttft], decode over [arrival + ttft, finish]."""
    finish = batch.finish_time_s
    arrival = finish - np.nan_to_num(batch.e2e_s, nan=0.0)
    first_token = np.where(np.isfinite(batch.ttft_s), arrival + batch.ttft_s, finish)
    scheduled = np.where(np.isfinite(batch.queue_s), arrival + batch.queue_s, first_token)
    arrived = arrival[np.isfinite(arrival) & np.isfinite(batch.e2e_s)]
    if arrived.size:
        first = float(arrived.min())
        folded.first_arrival_s = first if folded.first_arrival_s is None else min(folded.first_arrival_s, first)
    folded.input_timeline.add(scheduled, first_token, batch.num_prompt_tokens)
    folded.output_timeline.add(first_token, finish, batch.num_output_tokens)
