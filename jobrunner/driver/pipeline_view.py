"""A pipeline run's console view: a line when each stage starts (or resumes) and ends, and every `interval_s` one
line for all the stages, in the words of a job's progress lines (driver/progress.py, jobrunner/progress_view.py).

Each stage's job loop runs silently (no bar of its own: several would fight for the terminal); it hands its
Progress over through its StageHooks, and this view reads the counts there from the pipeline's main thread. The
funnel (rows in / kept / dropped by filter / error rows per stage) is summed from the footers of the files a
stage's rows were handed on to (io/stage_input.funnel_of), each file read once: files are written once, never
rewritten, so a periodic line costs one listing per stage. A stage's end line waits until the feed below it
has taken every committed shard (its funnel is then complete).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from jobrunner.driver.progress import PREFIX
from jobrunner.driver.stage_feed import StageFeed, StageHooks
from jobrunner.io.layout import PARTS_DIR
from jobrunner.io.stage_input import INPUT_DIR, STAGES_DIR, funnel_of, list_handed_on
from jobrunner.io.storage import Storage
from jobrunner.progress_view import duration
from jobrunner.redaction import say

FUNNEL_FIELDS = ("rows_in", "kept", "dropped", "filter_error", "error")


class FunnelTally:
    """The funnel of every stage so far: the handed-on files' footers, each file read once."""

    def __init__(self, root: Storage, names: list[str]) -> None:
        self.root, self.names = root, names
        self.seen: dict[str, set[str]] = {n: set() for n in names}
        self.totals: dict[str, dict[str, int]] = {n: dict.fromkeys(FUNNEL_FIELDS, 0) for n in names}

    def folder(self, index: int) -> str:
        names = self.names
        return f"{STAGES_DIR}/{names[index + 1]}/{INPUT_DIR}" if index + 1 < len(names) else PARTS_DIR

    def refresh(self) -> dict[str, dict[str, int]]:
        """Read the files handed on since the last call; every stage's totals."""
        for i, name in enumerate(self.names):
            try:
                new = [k for k in list_handed_on(self.root, self.folder(i)) if k not in self.seen[name]]
            except (OSError, ValueError):  # the folder is not there yet
                continue
            if new:
                found = funnel_of(self.root, new)
                for key in FUNNEL_FIELDS:
                    self.totals[name][key] += int(found[key])
                self.seen[name].update(new)
        return self.totals


def funnel_words(f: dict[str, int]) -> str:
    """'64 in -> 60 kept, 3 dropped by filter, 1 error row(s)' (filter errors only when there are some)."""
    errors = f", {f['filter_error']} filter error(s)" if f["filter_error"] else ""
    return f"{f['rows_in']:,} in -> {f['kept']:,} kept, {f['dropped']:,} dropped by filter{errors}, " \
           f"{f['error']:,} error row(s)"


class PipelineView:
    """Start / resume / end lines per stage and a periodic line of all stages; `poll` from the main thread."""

    def __init__(self, names: list[str], hooks: list[StageHooks], below: list[StageFeed], tally: FunnelTally,
                 file: TextIO | None = None, interval_s: float = 10.0, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic, started_s: float | None = None) -> None:
        self.names, self.hooks, self.below, self.tally = names, hooks, below, tally
        self.file, self.interval_s, self.enabled, self.clock = file or sys.stderr, interval_s, enabled, clock
        self.start = clock() if started_s is None else started_s
        self.started: set[str] = set()
        self.ended: set[str] = set()
        self.next_line = clock() + interval_s

    def poll(self, outcomes: dict[str, str | None], final: bool = False) -> None:
        """Print what is new. `outcomes`: stage -> None (finished every row) or why it stopped, for the stages
        whose run has ended; `final`: every thread is over (print the end lines that are left)."""
        if not self.enabled:
            return
        for i, name in enumerate(self.names):
            progress = self.hooks[i].progress
            if name not in self.started and progress is not None:
                self.started.add(name)
                self._say(self.start_line(i, progress))
        ending = [n for n in self.names if n in outcomes and n not in self.ended and
                  (final or self.below[self.names.index(n)].closed)]
        if ending:
            totals = self.tally.refresh()
            for name in ending:
                self._say(self.end_line(name, outcomes[name], totals[name]))
                self.ended.add(name)
        if not final and self.clock() >= self.next_line and len(self.ended) < len(self.names):
            self.next_line = self.clock() + self.interval_s
            self._say(self.line(self.tally.refresh()))

    def start_line(self, index: int, progress: Any) -> str:
        """'stage generate started: rows 0/64 (0%)', 'stage judge started: waits for stage generate's committed
        rows', 'stage judge resumes: 24 rows committed by earlier runs are kept' (the counts the stage began with)."""
        name, base, total = self.names[index], progress.base_prompts, progress.counts.prompts_total
        if base:
            rest = f", {total - base:,} of {total:,} to do" if not index else ""
            return f"{PREFIX} stage {name} resumes: {base:,} rows committed by earlier runs are kept{rest}"
        if index:
            return f"{PREFIX} stage {name} started: waits for stage {self.names[index - 1]}'s committed rows"
        return f"{PREFIX} stage {name} started: rows 0/{total:,} to do"

    def end_line(self, name: str, stopped: str | None, funnel: dict[str, int]) -> str:
        """'stage generate done: rows 64/64 (100%) | 64 in -> 60 kept, ... | elapsed 45s' (or 'stopped (why)')."""
        progress = self.hooks[self.names.index(name)].progress
        state = f"stopped ({stopped})" if stopped else "done"
        if progress is None or not progress.counts.prompts_total:
            counts = "no row reached it | "
        else:
            counts = progress.counts.text("committed" if stopped else "") + " | "
        return f"{PREFIX} stage {name} {state}: {counts}{funnel_words(funnel)} | elapsed {self._elapsed()}"

    def line(self, totals: dict[str, dict[str, int]]) -> str:
        """'pipeline | generate rows 40/64 (62%), 38 kept, 2 dropped, 0 errors | judge ... | elapsed 1m 05s'."""
        parts = []
        for i, name in enumerate(self.names):
            progress, f = self.hooks[i].progress, totals[name]
            if name in self.ended:
                parts.append(f"{name} done")
                continue
            if progress is None or (i and not progress.counts.prompts_total):
                parts.append(f"{name} waiting for {self.names[i - 1]}" if i else f"{name} starting")
                continue
            parts.append(f"{name} {progress.counts.text()}, {f['kept']:,} kept, {f['dropped']:,} dropped, "
                         f"{f['error']:,} error row(s)")
        return f"{PREFIX} pipeline | " + " | ".join(parts) + f" | elapsed {self._elapsed()}"

    def _elapsed(self) -> str:
        return duration(self.clock() - self.start)

    def _say(self, text: str) -> None:
        say(text, self.file)


def stage_outcomes(results: dict[str, Any], errors: dict[str, str]) -> dict[str, str | None]:
    """Stage -> None (its run finished every row) or why it stopped, for the stages whose run has ended."""
    out: dict[str, str | None] = {}
    for name, result in list(results.items()):
        if result is None:
            out[name] = errors.get(name, "stopped")
        else:
            out[name] = None if result.ok else (result.failure_message() or "not finished")
    return out
