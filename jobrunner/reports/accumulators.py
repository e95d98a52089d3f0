"""Bounded-memory accumulators that reports fold metric batches into (pure numpy, no I/O).

Percentiles are exact: `LatencyValues` keeps every non-null latency as float32 (4 bytes a value, so a
10-million-row output costs at most 4 x 40 MB for the four latency columns) and sorts once at the end.
`TokenTimeline` is a fixed-size histogram of tokens over the job's time whose bin width doubles (adjacent bins
merge) whenever the job outgrows it, so its memory does not depend on the job's length or row count.
"""

from __future__ import annotations

import re

import numpy as np

from jobrunner.io.images import image_error_kind

QUANTILES = {"p50": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0}
CDF_POINTS = 201  # quantile points kept for a CDF chart


class LatencyValues:
    """All non-null values of one latency column, kept as float32 chunks until `summary()`."""

    def __init__(self) -> None:
        self._chunks: list[np.ndarray] = []
        self._sorted: np.ndarray | None = None

    def add(self, values: np.ndarray) -> None:
        """Append the finite values of `values` (NaN marks a null)."""
        finite = values[np.isfinite(values)]
        if finite.size:
            self._chunks.append(finite.astype(np.float32))
            self._sorted = None

    def sorted_values(self) -> np.ndarray:
        """Every value kept, ascending, float32; sorted once in place (the chunks are dropped)."""
        if self._sorted is None:
            joined = np.concatenate(self._chunks) if self._chunks else np.empty(0, np.float32)
            joined.sort()
            self._chunks = [joined] if joined.size else []
            self._sorted = joined
        return self._sorted

    def quantiles(self, shares: np.ndarray) -> np.ndarray:
        """Values at `shares` in [0, 1], linear interpolation between ranks (numpy's default method)."""
        values = self.sorted_values()
        position = shares * (values.size - 1)
        low = np.floor(position).astype(np.int64)
        high = np.minimum(low + 1, values.size - 1)
        below, above = values[low].astype(np.float64), values[high].astype(np.float64)
        return below + (above - below) * (position - low)

    def summary(self) -> dict:
        """count, mean, p50/p90/p95/p99 and max; None when empty."""
        values = self.sorted_values()
        if values.size == 0:
            return {"count": 0, "mean": None, **{name: None for name in QUANTILES}, "max": None}
        percentiles = self.quantiles(np.array(list(QUANTILES.values())) / 100.0)
        return {"count": int(values.size), "mean": float(values.mean(dtype=np.float64)),
                **{name: float(v) for name, v in zip(QUANTILES, percentiles, strict=True)},
                "max": float(values[-1])}

    def cdf(self) -> dict:
        """CDF_POINTS (value, cumulative share) points for a chart."""
        if self.sorted_values().size == 0:
            return {"x": [], "p": []}
        shares = np.linspace(0.0, 1.0, CDF_POINTS)
        return {"x": [float(v) for v in self.quantiles(shares)], "p": [float(p) for p in shares]}


class TokenTimeline:
    """Tokens over job time, each row's tokens spread evenly over the interval in which they were produced.

    A row's prefill (input) tokens are spread over [first scheduled, first token] and its decode (output)
    tokens over [first token, finish]; a zero-length interval is a point. The token count in a bin is an
    integral of a sum of ramps, kept exactly with per-bin sums of rates (sum r, sum r*t at each interval's
    start and end) and point masses, so adjacent bins can be merged without losing anything.
    """

    def __init__(self, max_bins: int = 256, first_bin_s: float = 2.0**-6) -> None:
        self.max_bins = max_bins
        self.bin_s = first_bin_s
        # [5, max_bins]: rate sum / rate*t sum at interval starts, the same at ends, point masses.
        self._sums = np.zeros((5, max_bins))

    def add(self, start_s: np.ndarray, end_s: np.ndarray, tokens: np.ndarray) -> None:
        """Add `tokens[i]` produced evenly over [start_s[i], end_s[i]] (seconds since job start)."""
        keep = np.isfinite(start_s) & np.isfinite(end_s) & (tokens > 0)
        start = np.maximum(start_s[keep], 0.0)
        end = np.maximum(end_s[keep], start)
        tokens = tokens[keep].astype(np.float64)
        if tokens.size == 0:
            return
        self._grow_to(float(end.max()))
        is_point = (end - start) <= 1e-9
        rate = np.where(is_point, 0.0, tokens / np.where(is_point, 1.0, end - start))
        self._add_at(0, start, rate, rate * start)
        self._add_at(2, end, rate, rate * end)
        self._add_at(4, end[is_point], tokens[is_point], None)

    def _add_at(self, row: int, times: np.ndarray, weights: np.ndarray, weights_t: np.ndarray | None) -> None:
        index = np.minimum((times / self.bin_s).astype(np.int64), self.max_bins - 1)
        self._sums[row] += np.bincount(index, weights, minlength=self.max_bins)
        if weights_t is not None:
            self._sums[row + 1] += np.bincount(index, weights_t, minlength=self.max_bins)

    def _grow_to(self, time_s: float) -> None:
        while time_s >= self.bin_s * self.max_bins:
            half = self._sums.reshape(5, self.max_bins // 2, 2).sum(axis=2)
            self._sums = np.concatenate([half, np.zeros_like(half)], axis=1)
            self.bin_s *= 2.0

    def tokens_per_bin(self) -> np.ndarray:
        """Tokens produced in each bin [k*bin_s, (k+1)*bin_s)."""
        edges = np.arange(self.max_bins + 1) * self.bin_s
        cumulative = np.zeros((5, self.max_bins + 1))
        cumulative[:, 1:] = np.cumsum(self._sums, axis=1)
        ramps_started = edges * cumulative[0] - cumulative[1]
        ramps_ended = edges * cumulative[2] - cumulative[3]
        produced_by_edge = ramps_started - ramps_ended + cumulative[4]
        return np.diff(produced_by_edge)

    def rate_series(self, until_s: float | None = None, max_points: int = 80) -> dict:
        """{"bin_s", "t": bin centres, "tokens_per_s"} up to the last non-empty bin (or `until_s`), with
        adjacent bins merged so that there are at most `max_points` (a readable, not too noisy line)."""
        per_bin = self.tokens_per_bin()
        used = np.flatnonzero(per_bin > 1e-9)
        last = int(used[-1]) + 1 if used.size else 0
        if until_s is not None and until_s > 0:
            last = max(last, min(self.max_bins, int(np.ceil(until_s / self.bin_s))))
        group = max(1, int(np.ceil(last / max_points)))
        padded = np.zeros(int(np.ceil(last / group)) * group)
        padded[:last] = per_bin[:last]
        merged = padded.reshape(-1, group).sum(axis=1)
        bin_s = self.bin_s * group
        centres = (np.arange(merged.size) + 0.5) * bin_s
        return {"bin_s": bin_s, "t": [float(t) for t in centres],
                "tokens_per_s": [max(0.0, float(v)) / bin_s for v in merged]}


_DIGITS = re.compile(r"\d+")


def error_kind(error: str) -> str:
    """A short kind for an error message: the text before the first ':' with numbers folded to 'N' (a row's
    image error: ``image: <why>``, its row and image left out)."""
    image = image_error_kind(error)
    if image:  # "image: " and the reason's head
        image = "image: " + image[len("image: "):].split(":", 1)[0].split(" (", 1)[0]
    head = (image or error.split(":", 1)[0].strip()) or "error"
    head = _DIGITS.sub("N", head)
    return head if len(head) <= 60 else head[:57] + "..."


OTHER_KINDS = "(other kinds)"


def add_counts(target: dict[str, int], source: dict[str, int], key=lambda k: k, max_keys: int = 1000) -> None:
    """target[key(k)] += n for every k, n in source; past `max_keys` kinds, new ones count as OTHER_KINDS."""
    for name, count in source.items():
        kind = key(name)
        if kind not in target and len(target) >= max_keys:
            kind = OTHER_KINDS
        target[kind] = target.get(kind, 0) + int(count)
