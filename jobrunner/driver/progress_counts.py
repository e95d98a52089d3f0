"""The driver's counts of a running job, in the one vocabulary of jobrunner/progress_view.py.

Prompts, samples and tokens come from four places, each counted once: committed shards (the shard table at
the start of the run, then each commit), shards being published, finished pieces of split shards, and the
rows finished inside running shards (worker polls). Tokens are of the task's kind (output tokens for
generation, prompt tokens for embed / score). Output tokens sampled for rows not finished yet (the engines'
own count) give the in-flight work a share of a prompt each, so the ETA moves while rows decode together
and end together, instead of waiting for whole rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from jobrunner.driver.shards import ShardTable
from jobrunner.io.shard_file import COMMITTED, COUNT_COLUMNS
from jobrunner.progress_view import Counts, counts_of, entry_prompts, entry_samples

IN_FLIGHT_CAP = 0.9  # in-flight rows may stand for at most this share of the prompts left (an estimate)


class ShardProgress(NamedTuple):
    """What a worker reports of one shard it is running, at each poll (finished requests only)."""

    rows: int = 0  # output rows written so far (an error row is one)
    output_tokens: int = 0
    prompts: int = 0  # input rows done
    samples: int = 0  # samples done: an error row counts as its n
    prompt_tokens: int = 0  # prompt tokens of the rows done (a prompt shared by n samples once)

    def plus(self, other: ShardProgress) -> ShardProgress:
        return ShardProgress(*(a + b for a, b in zip(self, other, strict=True)))


def entry_progress(entry: dict[str, Any]) -> ShardProgress:
    """A commit record (or manifest entry) as counts."""
    return ShardProgress(int(entry.get("rows") or 0), int(entry.get("num_output_tokens") or 0), entry_prompts(entry),
                         entry_samples(entry), int(entry.get("num_prompt_tokens") or 0))


def result_progress(result: Any) -> ShardProgress:
    """A worker's ShardResult (a finished piece of a shard) as counts."""
    prompts = max(int(result.row_end) - int(result.row_start), 0)
    return ShardProgress(result.rows, result.num_output_tokens, prompts, result.samples or result.rows,
                         result.num_prompt_tokens)


class CommittedCounts:
    """Prompts, samples and tokens of the committed shards: read from the shard table once, then per commit."""

    def __init__(self, shards: ShardTable) -> None:
        columns = shards.columns
        committed = columns.status == COMMITTED
        ranges = columns.row_end - columns.row_start
        samples = columns.counts[:, COUNT_COLUMNS.index("num_samples")]
        samples = np.where(samples > 0, samples, columns.counts[:, COUNT_COLUMNS.index("rows")])
        self.prompts_total = int(ranges.sum())
        self.prompts = int(ranges[committed].sum())
        self.samples = int(samples[committed].sum())
        self.prompts_at_start = self.prompts
        self.this_run = ShardProgress()  # what this run committed

    def add(self, record: dict[str, Any]) -> None:
        """A shard this run committed."""
        done = entry_progress(record)
        self.prompts += done.prompts
        self.samples += done.samples
        self.this_run = self.this_run.plus(done)


@dataclass(frozen=True)
class Snapshot:
    """The run's counts now: prompts / samples, tokens of the task's kind this run, in-flight prompts."""

    counts: Counts
    tokens: int
    in_flight: float = 0.0  # rows being decoded, as a share of prompts (for the ETA)


def snapshot(committed: CommittedCounts, finished: ShardProgress, n: int, kind: str, tokens_produced: int,
             tokens_per_prompt: float) -> Snapshot:
    """The counts from the committed shards plus `finished` (publishing, finished pieces, rows finished in
    running shards); `tokens_produced`: output tokens the engines sampled this run (0 when not counted);
    `tokens_per_prompt`: the most output tokens a prompt can take (max_tokens x n; 0 when not known)."""
    counts = counts_of(committed.prompts + finished.prompts, committed.prompts_total,
                       committed.samples + finished.samples, n)
    done = committed.this_run.plus(finished)
    if kind == "in":
        return Snapshot(counts, done.prompt_tokens)
    tokens = max(done.output_tokens, tokens_produced)
    # a prompt still decoding counts by its tokens over max_tokens x n: the rows that finish first are the short
    # ones, so the finished rows' average would count the long rows still decoding as nearly done (the example
    # job showed ETA 2s with 50 s left); the finished rows' average only where max_tokens is not known
    average = done.output_tokens / done.prompts if done.prompts and done.output_tokens else 0.0
    per_prompt = tokens_per_prompt if tokens_per_prompt > 0 else average
    left = counts.prompts_total - counts.prompts_done
    in_flight = min((tokens - done.output_tokens) / per_prompt, IN_FLIGHT_CAP * left) if per_prompt > 0 else 0.0
    return Snapshot(counts, tokens, max(in_flight, 0.0))
