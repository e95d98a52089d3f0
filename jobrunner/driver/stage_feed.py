"""A pipeline stage's feed: its shards, one per committed shard of the previous stage, found as they land.

The job loop of a later stage (driver/job.py) polls its feed every round; the feed polls at most every `poll_s`.
A poll reads the previous stage's manifest (its shard table again only after a compaction wrote a new one) and
the commit records of shards it has not seen (io/stage_input.CommittedLister), and for each committed shard it
has not seen writes the stage's input file `_input/<shard id>.parquet` (io/stage_input.hand_on: the rows that go
on; an existing file is reused, never rewritten) and hands the loop a shard with **the upstream shard's id** and
all the file's rows. The ids are a function of the upstream ids alone, so a rerun after a crash re-derives the
same shards: the ones committed before (kept by driver/output.py as an incremental run keeps its own) are known
and skipped, the rest run. An upstream shard whose rows all stopped (errors, filtered) gives an input file of 0
rows and no shard. The feed closes on the first poll that starts after the previous stage's run ended, so
nothing committed upstream is missed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jobrunner.driver.plan import JobPlan
from jobrunner.driver.shards import ShardTable, plan_shards
from jobrunner.io.stage_input import CommittedLister, hand_on, input_key
from jobrunner.io.storage import Storage
from jobrunner.pipeline.handoff import Handoff

POLL_S = 0.5


@dataclass(frozen=True)
class FedShard:
    """One shard a feed found: the upstream shard's id, the stage input file written for it, its rows."""

    shard_id: str
    file_url: str
    num_rows: int


@dataclass
class StageHooks:
    """What the pipeline gives one stage's job loop: its feed (None for the first stage, which plans its input
    as any job does) and the pipeline's stop signal (Ctrl-C in the main thread, or a stage that failed). The job
    loop sets `progress` to its (silent) Progress: the pipeline's console view reads the stage's counts there."""

    feed: StageFeed | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    progress: Any = None  # driver/progress.Progress, once the stage's job loop has started


class StageFeed:
    """New shards of a stage from the previous stage's output (`upstream`)."""

    def __init__(self, upstream: Storage, handoff: Handoff, rows_per_shard: int, poll_s: float = POLL_S,
                 key_of: Callable[[str], str] = input_key) -> None:
        self.upstream, self.handoff, self.poll_s, self.key_of = upstream, handoff, poll_s, key_of
        self.lister = CommittedLister(upstream)
        self.rows_per_shard = rows_per_shard
        self.target: Storage | None = None  # the stage's output (fenced by its lease): attach()
        self.known: set[str] = set()
        self.ended = threading.Event()  # the previous stage's run ended
        self.upstream_ok = False  # ... and finished every shard
        self.closed = False
        self.next_poll = 0.0
        self.num_fed = 0
        self.num_empty = 0

    def plan(self) -> JobPlan:
        """The stage's starting plan: no shards (driver/output.py keeps the committed ones of earlier runs)."""
        return JobPlan(files=[], shards=plan_shards([], self.rows_per_shard), stage=True)

    def attach(self, target: Storage, table: ShardTable | None) -> None:
        """The stage's output, opened under its lease, and its table as planned: those ids are known (None: the
        pipeline's final rows, whose existing parts are found by key)."""
        self.target = target
        self.known = set() if table is None else {table.id_of(i) for i in range(len(table))}

    def upstream_ended(self, ok: bool) -> None:
        """The previous stage's run is over (`ok`: it finished every shard)."""
        self.upstream_ok = ok
        self.ended.set()

    @property
    def is_open(self) -> bool:
        return not self.closed

    def poll(self) -> list[FedShard]:
        """Shards committed upstream since the last poll (their input files written); [] between polls."""
        if self.closed or time.monotonic() < self.next_poll:
            return []
        assert self.target is not None, "attach() first"
        ended = self.ended.is_set()  # read before listing: a poll begun after the end sees every commit
        fed = []
        for shard_id, parts in sorted(self.lister.new_shards(self.known).items()):
            key = self.key_of(shard_id)
            num_rows = hand_on(self.upstream, parts, self.target, key, self.handoff)
            self.known.add(shard_id)
            if num_rows:
                fed.append(FedShard(shard_id, f"{self.target.url}/{key}", num_rows))
            else:
                self.num_empty += 1
        self.num_fed += len(fed)
        self.closed = ended
        self.next_poll = time.monotonic() + self.poll_s
        return fed
