"""One driver-side progress display: a tqdm bar on a terminal, plain lines in logs (Ray job logs, files).

What a person sees, in order: start-up stages as their own lines (starting Ray, placing workers with the
resources asked, loading the model, warming up), then prompts (and samples, where n > 1) done / total, tokens
and tokens/s of the task's kind (output for generation, input for embed / score), the command's elapsed time
and an ETA, and a final line when the run ends. The words and numbers are jobrunner/progress_view.py's, the
same that `jobrunner status` prints. Counts only go up: `update` takes absolute counts (driver/
progress_counts.py: committed shards, shards being published, rows finished inside running shards, tokens the
engines report as they produce them), and a late or stale report must never move the display backwards.
Tokens/s is the rate over the last RATE_WINDOW_S seconds, so start-up does not dilute it; the final line gives
the average since the first token. The ETA counts rows still decoding by the tokens they have (`in_flight`),
so a batch of rows that end together does not leave it stuck. A run that stops early (an interrupt) ends on
what is committed: what `jobrunner status` shows and a rerun keeps.

On a terminal, anything else written to stdout / stderr while the bar is shown (Ray's warnings, worker log
lines, Python logging) is written on its own lines above the bar, never glued to it.
"""

from __future__ import annotations

import io
import logging
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from tqdm import tqdm

from jobrunner.progress_view import Counts, duration, eta_s, token_words
from jobrunner.redaction import say

PREFIX = "[jobrunner]"
RATE_WINDOW_S = 30.0


class Progress:
    """Prompts / samples done, tokens/s and ETA; `update` takes absolute counts and never goes back.

    `started_s`: when the command started (this clock; default now), for "elapsed"; `kind`: "out" or "in",
    the tokens counted (progress_view.token_kind)."""

    def __init__(self, counts: Counts, file: TextIO | None = None, interval_s: float = 10.0, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic, started_s: float | None = None,
                 kind: str = "out") -> None:
        self.file = file or sys.stderr
        self.counts, self.base_prompts, self.enabled = counts, counts.prompts_done, enabled
        self.interval_s, self.kind = interval_s, kind
        self.clock = clock  # seconds, monotonic (tests pass a fake one so rates and ETAs are exact)
        self.start = self.clock() if started_s is None else started_s
        self.tokens, self.in_flight, self.last_line = 0, 0.0, float("-inf")
        self.first_work_at: float | None = None  # the report before the first token (or prompt) of this run
        self.token_reports = 0  # reports whose token count went up: one alone dates no rate
        self.samples: deque[tuple[float, int]] = deque()  # (time, tokens) over the last RATE_WINDOW_S
        self.is_tty = bool(getattr(self.file, "isatty", lambda: False)())
        self.bar: tqdm | None = None
        self._redirect: Any = None
        self.closed = False

    # ---- what the driver calls --------------------------------------------------------------------------
    def stage(self, text: str) -> None:
        """A start-up stage (or any event worth a line): printed at once, on its own line."""
        if self.enabled and not self.closed:
            self._write_line(f"{PREFIX} {text}")

    def update(self, counts: Counts, tokens: int, in_flight: float = 0.0) -> None:
        """Take the counts (all runs), this run's tokens and the prompts decoding (as a share); only up."""
        if self.closed:
            return
        self._take(counts, tokens, in_flight)
        if not self.enabled:
            return
        if self.is_tty:
            self._draw_bar()
        elif self.clock() - self.last_line >= self.interval_s:
            self.last_line = self.clock()
            say(self.line(), self.file)

    def close(self, counts: Counts | None = None, tokens: int | None = None, stopped: str | None = None) -> None:
        """Take the final counts, finish the bar and print the final line (once). `stopped`: why the run
        stopped early (then `counts` are the committed ones, and the line says so and gives the elapsed time)."""
        if self.closed:
            return
        if counts is not None:
            self.counts = counts  # final: the committed counts may be below what was shown in flight
            self._take(counts, self.tokens if tokens is None else tokens, 0.0)
        if self.bar is not None:
            self._draw_bar()
            self.bar.close()
            self._stop_redirect()
        self.closed = True
        if self.enabled:
            say(self.final_line(stopped), self.file)

    # ---- numbers ----------------------------------------------------------------------------------------
    def _take(self, counts: Counts, tokens: int, in_flight: float) -> None:
        now = self.clock()
        self.counts = self.counts.at_least(counts)
        self.in_flight = in_flight
        self.token_reports += tokens > self.tokens
        self.tokens = max(self.tokens, tokens)
        if (self.tokens or self.counts.prompts_done > self.base_prompts) and self.first_work_at is None:
            # these tokens were made after the previous report (which had none), not at this instant: a job whose
            # tokens all arrive in one report would otherwise show a rate over a span of microseconds
            self.first_work_at = self.samples[-1][0] if self.samples else self.start
        self.samples.append((now, self.tokens))
        while len(self.samples) > 2 and now - self.samples[0][0] > RATE_WINDOW_S:
            self.samples.popleft()

    def tokens_per_s(self) -> float:
        """Tokens/s over the last RATE_WINDOW_S seconds (0 before two reports)."""
        if len(self.samples) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self.samples[0], self.samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def average_tokens_per_s(self) -> float:
        """Tokens/s since the last report before the first token (when this run's work started)."""
        if self.first_work_at is None:
            return 0.0
        return self.tokens / max(self.clock() - self.first_work_at, 1e-6)

    def eta_s(self) -> float | None:
        """Seconds left at this run's pace since its first token, rows decoding counted by their share."""
        c = self.counts
        if c.is_done:
            return 0.0
        if self.first_work_at is None:
            return None
        left = c.prompts_total - c.prompts_done - self.in_flight
        return eta_s(c.prompts_done - self.base_prompts + self.in_flight, left, self.clock() - self.first_work_at)

    # ---- text -------------------------------------------------------------------------------------------
    def line(self) -> str:
        """A plain progress line for logs."""
        eta = self.eta_s()
        tokens, rate = token_words(self.kind)
        return (f"{PREFIX} {self.counts.text()} | {self.tokens:,} {tokens}, {self.tokens_per_s():.1f} {rate} | "
                f"elapsed {duration(self.clock() - self.start)} | ETA {'?' if eta is None else duration(eta)}")

    def final_line(self, stopped: str | None = None) -> str:
        """The last line: 'done' when every prompt is, 'stopped (why)' for a run cut short (committed counts and
        the elapsed time: nothing follows), else 'ended' (committed counts), with the average rate."""
        tokens, rate_words = token_words(self.kind)
        if self.token_reports >= 2:
            rate = f"{self.average_tokens_per_s():.1f} {rate_words} since the first token"
        else:  # every token came in one report (a tiny job): only the whole run's time is known
            elapsed = self.clock() - self.start
            rate = f"{self.tokens / max(elapsed, 1e-6):.1f} {rate_words} over the whole run (start-up included)"
        done = self.counts.is_done and stopped is None
        state = "done" if done else f"stopped ({stopped})" if stopped else "ended"
        text = (f"{PREFIX} {state}: {self.counts.text('' if done else 'committed')} | {self.tokens:,} {tokens} "
                f"in this run, {rate}")
        if stopped:
            text += f" | elapsed {duration(self.clock() - self.start)}; a rerun goes on from the committed rows"
        return text

    # ---- terminal -----------------------------------------------------------------------------------------
    def _draw_bar(self) -> None:
        c = self.counts
        if self.bar is None:
            self.bar = tqdm(total=c.prompts_total, initial=c.prompts_done, unit="prompt" if c.shows_samples else "row",
                            file=self.file, dynamic_ncols=True, desc=PREFIX, mininterval=0.2)
            self._start_redirect()
        self.bar.total = c.prompts_total
        self.bar.n = c.prompts_done
        eta = self.eta_s()
        samples = f"samples {c.samples_done:,}/{c.samples_total:,}, " if c.shows_samples else ""
        self.bar.set_postfix_str(f"{samples}{self.tokens_per_s():.1f} {token_words(self.kind)[1]}, ETA "
                                 f"{'?' if eta is None else duration(eta)}", refresh=False)
        self.bar.refresh()

    def _write_line(self, text: str) -> None:
        """A stage line (a model source, an address: redacted by `say`), above the bar when one is shown."""
        if self.bar is not None:
            with tqdm.external_write_mode(file=self.file):
                say(text, self.file)
        else:
            say(text, self.file)

    def _start_redirect(self) -> None:
        self._redirect = _above_bar(self.file)
        self._redirect.__enter__()

    def _stop_redirect(self) -> None:
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None


class _LinesAboveBar(io.TextIOBase):
    """A stdout / stderr stand-in: whole lines go to the real stream with the bar cleared first."""

    def __init__(self, real: TextIO, bar_file: TextIO) -> None:
        super().__init__()
        self.real, self.bar_file, self.pending = real, bar_file, ""

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in self.pending:
            lines, _, self.pending = self.pending.rpartition("\n")
            with tqdm.external_write_mode(file=self.bar_file):
                self.real.write(lines + "\n")
                self.real.flush()
        return len(text)

    def flush(self) -> None:
        self.real.flush()

    def isatty(self) -> bool:
        return self.real.isatty()

    def fileno(self) -> int:
        return self.real.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.real, "encoding", "utf-8")

    def finish(self) -> None:
        """Write what is left of a last unfinished line."""
        if self.pending:
            text, self.pending = self.pending, ""
            with tqdm.external_write_mode(file=self.bar_file):
                self.real.write(text + "\n")


@contextmanager
def _above_bar(bar_file: TextIO) -> Iterator[None]:
    """While the bar is shown: sys.stdout / sys.stderr and logging handlers on them write above the bar."""
    saved = sys.stdout, sys.stderr
    proxies = {id(s): _LinesAboveBar(s, bar_file) for s in saved}
    sys.stdout, sys.stderr = proxies[id(saved[0])], proxies[id(saved[1])]
    handlers = [h for h in _stream_handlers() if id(h.stream) in proxies]
    old_streams = [h.setStream(proxies[id(h.stream)]) for h in handlers]
    try:
        yield
    finally:
        for handler, stream in zip(handlers, old_streams):
            handler.setStream(stream)
        sys.stdout, sys.stderr = saved
        for proxy in proxies.values():
            proxy.finish()


def _stream_handlers() -> list[logging.StreamHandler]:
    loggers = [logging.getLogger()] + [v for v in logging.Logger.manager.loggerDict.values()
                                       if isinstance(v, logging.Logger)]
    return [h for lg in loggers for h in lg.handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]

