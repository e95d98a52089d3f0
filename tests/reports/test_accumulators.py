"""Exact percentiles, the token timeline's conservation and error kinds."""

from __future__ import annotations

import numpy as np
import pytest

from jobrunner.reports.accumulators import LatencyValues, TokenTimeline, add_counts, error_kind


def test_percentiles_are_exact_over_chunks_and_skip_nulls() -> None:
    values = LatencyValues()
    values.add(np.array([4.0, np.nan, 1.0]))
    values.add(np.array([3.0, 2.0, 5.0]))
    summary = values.summary()
    assert summary["count"] == 5
    assert summary["p50"] == pytest.approx(3.0)
    assert summary["p90"] == pytest.approx(4.6)  # linear interpolation between ranks
    assert summary["p99"] == pytest.approx(4.96)
    assert summary["max"] == 5.0
    assert summary["mean"] == pytest.approx(3.0)


def test_empty_latency_is_none_not_nan() -> None:
    values = LatencyValues()
    values.add(np.array([np.nan, np.nan]))
    summary = values.summary()
    assert summary["count"] == 0 and summary["p99"] is None and summary["max"] is None
    assert values.cdf() == {"x": [], "p": []}


def test_cdf_goes_from_min_to_max() -> None:
    values = LatencyValues()
    values.add(np.linspace(0.0, 2.0, 1001))
    cdf = values.cdf()
    assert cdf["x"][0] == 0.0 and cdf["x"][-1] == pytest.approx(2.0)
    assert cdf["p"][0] == 0.0 and cdf["p"][-1] == 1.0
    assert cdf["x"][100] == pytest.approx(1.0, abs=1e-6)


def test_timeline_spreads_tokens_evenly_over_their_interval() -> None:
    timeline = TokenTimeline(max_bins=8, first_bin_s=1.0)
    timeline.add(np.array([1.0]), np.array([3.0]), np.array([10]))  # 5 tokens/s over [1, 3)
    timeline.add(np.array([5.5]), np.array([5.5]), np.array([7]))  # a point mass
    assert timeline.tokens_per_bin() == pytest.approx([0, 5, 5, 0, 0, 7, 0, 0])


def test_timeline_grows_by_merging_bins_and_conserves_tokens() -> None:
    rng = np.random.default_rng(0)
    timeline = TokenTimeline(max_bins=16, first_bin_s=0.01)
    total = 0
    for scale in (1.0, 10.0, 1000.0):  # later batches push the bin width up by doubling
        start = rng.uniform(0, scale, 500)
        end = start + rng.exponential(scale / 10, 500)
        tokens = rng.integers(0, 50, 500)
        timeline.add(start, end, tokens)
        total += int(tokens.sum())
    assert timeline.bin_s * timeline.max_bins > 1000.0
    assert timeline.tokens_per_bin().sum() == pytest.approx(total)
    series = timeline.rate_series(max_points=5)
    assert len(series["t"]) <= 5
    assert sum(series["tokens_per_s"]) * series["bin_s"] == pytest.approx(total)


def test_timeline_ignores_rows_without_times() -> None:
    timeline = TokenTimeline()
    timeline.add(np.array([np.nan, 1.0]), np.array([1.0, np.nan]), np.array([5, 5]))
    assert timeline.tokens_per_bin().sum() == 0
    assert timeline.rate_series()["t"] == []


@pytest.mark.parametrize(("message", "kind"), [
    ("prompt too long: 5000 > 2048 tokens", "prompt too long"),
    ("ValueError: bad temperature -1", "ValueError"),
    ("shard 12 timed out after 300 s", "shard N timed out after N s"),
    (": nothing before the colon", "error"),
    ("x" * 100, "x" * 57 + "..."),
])
def test_error_kind(message: str, kind: str) -> None:
    assert error_kind(message) == kind


def test_add_counts_groups_by_key() -> None:
    counts: dict[str, int] = {"a": 1}
    add_counts(counts, {"a: 1": 2, "a: 2": 3, "b": 1}, error_kind)
    assert counts == {"a": 6, "b": 1}



def test_error_kinds_stay_bounded() -> None:
    counts: dict[str, int] = {}
    add_counts(counts, {f"kind{chr(65 + i)}: x": 1 for i in range(10)}, error_kind, max_keys=4)
    assert len(counts) == 5 and counts["(other kinds)"] == 6
