"""One vocabulary of counts: what the live log, the progress bar, the end of a run and `jobrunner status` say.

A job's unit of work is a **prompt** (an input row). A prompt asks for n **samples** (`sampling.n`, or the
row's own n); each sample is an output row. A prompt that failed before the engine (a null prompt, a bad
per-row value) writes one error row, yet it is done: it counts as its n samples, so a job whose every row
failed ends at 100%, not at 1/n. Where n is 1 the two are the same and the line says "rows"; where it is not,
both are shown ("prompts 13/40 · samples 39/120 (33%)"). The share done is the prompts' (exact: the plan
knows every prompt); the samples total is an estimate until the end (per-row n), then exact.

Tokens/s are of the task's own kind: output tokens for generation, input (prompt) tokens for embed and score,
which produce none. The ETA has one formula (`eta_s`) over the work done in this run, committed and in flight.
Pure Python, no I/O: the driver (driver/progress.py) and `jobrunner status` (reports/status.py) both use it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

MIN_ETA_PROGRESS = 1e-9  # less work done than this in the run: no ETA yet


@dataclass(frozen=True)
class Counts:
    """Prompts and samples done / planned (all runs of the output), and the job's n."""

    prompts_done: int
    prompts_total: int
    samples_done: int
    samples_total: int
    n: int = 1  # the job's samples per prompt (sampling.n; 1 for embed / score)

    @property
    def is_done(self) -> bool:
        return self.prompts_done >= self.prompts_total

    @property
    def fraction(self) -> float:
        """Share of the prompts done (1.0 for a job with none)."""
        return min(self.prompts_done / self.prompts_total, 1.0) if self.prompts_total else 1.0

    @property
    def shows_samples(self) -> bool:
        """Whether samples differ from prompts (n > 1, or per-row n): then both are shown."""
        return self.n > 1 or self.samples_done != self.prompts_done or self.samples_total != self.prompts_total

    def text(self, basis: str = "") -> str:
        """'rows 13/40 (33%)', or 'prompts 13/40 · samples 39/120 (33%)'; `basis` ('committed') after the
        numbers."""
        tail = f" {basis}" if basis else ""
        pct = f"({math.floor(100 * self.fraction)}%)"  # floored: 100% only once every prompt is done
        if not self.shows_samples:
            return f"rows {self.prompts_done:,}/{self.prompts_total:,}{tail} {pct}"
        return (f"prompts {self.prompts_done:,}/{self.prompts_total:,} · samples {self.samples_done:,}/"
                f"{self.samples_total:,}{tail} {pct}")

    def at_least(self, other: Counts) -> Counts:
        """The larger of two counts of the same job, field by field (counts never go back)."""
        return Counts(*(max(a, b) for a, b in zip(astuple(self), astuple(other), strict=True)))

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def astuple(c: Counts) -> tuple[int, int, int, int, int]:
    return (c.prompts_done, c.prompts_total, c.samples_done, c.samples_total, c.n)


def counts_of(prompts_done: int, prompts_total: int, samples_done: int, n: int) -> Counts:
    """Counts with the samples total projected: the samples done plus n for each prompt left (exact at the end,
    where per-row n made prompts x n wrong)."""
    prompts_total = max(prompts_total, prompts_done)
    return Counts(prompts_done, prompts_total, samples_done, samples_done + (prompts_total - prompts_done) * n, n)


def counts_from_dict(data: Any) -> Counts | None:
    """Counts from `to_dict` (a heartbeat, a JSON status); None when they are not there."""
    if not isinstance(data, dict):
        return None
    try:
        return Counts(*(int(data[k]) for k in ("prompts_done", "prompts_total", "samples_done", "samples_total")),
                      n=int(data.get("n") or 1))
    except (KeyError, TypeError, ValueError):
        return None


def entry_samples(entry: dict[str, Any]) -> int:
    """A shard's samples from its manifest entry or commit record (`num_samples`; its rows when an older
    driver wrote it)."""
    return int(entry.get("num_samples") or entry.get("rows") or 0)


def entry_prompts(entry: dict[str, Any]) -> int:
    """A shard's prompts from its manifest entry or commit record: its input row range."""
    return max(int(entry.get("row_end") or 0) - int(entry.get("row_start") or 0), 0)


def job_n(task: str | None, n: Any) -> int:
    """Samples per prompt: the job's sampling.n for generation, 1 for embed / score."""
    return 1 if task in ("embed", "score") else max(int(n or 1), 1)


def token_kind(task: str | None) -> str:
    """'out' for generation, 'in' for embed / score (they read prompts and produce no token)."""
    return "in" if task in ("embed", "score") else "out"


def token_words(kind: str) -> tuple[str, str]:
    """('out tokens', 'out tok/s') or ('in tokens', 'in tok/s')."""
    return f"{kind} tokens", f"{kind} tok/s"


def eta_s(progress_this_run: float, left: float, seconds_this_run: float) -> float | None:
    """Seconds left at this run's pace: `left` units of work (prompts, in-flight ones counted in part) after
    `progress_this_run` units in `seconds_this_run`; 0 when nothing is left, None before any progress."""
    if left <= 0:
        return 0.0
    if progress_this_run < MIN_ETA_PROGRESS or seconds_this_run <= 0:
        return None
    return left * seconds_this_run / progress_this_run


def duration(seconds: float) -> str:
    """'42s', '3m05s', '1h02m'."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
