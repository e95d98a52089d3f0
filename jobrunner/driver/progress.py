"""One driver-side progress display: a tqdm bar on a terminal, plain lines in logs (Ray job logs, files).

What a person sees, in order: start-up stages as their own lines (starting Ray, placing workers with the
resources asked, loading the model, warming up), then rows done / total, output tokens/s and an ETA, and a
final line when the run ends. Counts only go up: `update` takes absolute counts from several sources (shards
committed, rows finished inside running shards, tokens the engines report as they produce them), and a late
or stale report must never move the display backwards. Tokens/s is the rate over the last RATE_WINDOW_S
seconds, so start-up does not dilute it; the final line gives the average since the first token.

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

from jobrunner.redaction import say

PREFIX = "[jobrunner]"
RATE_WINDOW_S = 30.0


class Progress:
    """Rows done / total, output tokens/s and ETA; `update` takes absolute counts and never goes back."""

    def __init__(self, total_rows: int, done_rows: int = 0, file: TextIO | None = None,
                 interval_s: float = 10.0, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.file = file or sys.stderr
        self.total, self.base_rows, self.enabled = total_rows, done_rows, enabled
        self.interval_s = interval_s
        self.clock = clock  # seconds, monotonic (tests pass a fake one so rates and ETAs are exact)
        self.start = self.clock()
        self.rows, self.tokens, self.last_line = done_rows, 0, float("-inf")
        self.first_token_at: float | None = None
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

    def update(self, rows: int, output_tokens: int) -> None:
        """Set the rows done (all runs) and output tokens produced in this run; both only ever go up."""
        if self.closed:
            return
        self._take(rows, output_tokens)
        if not self.enabled:
            return
        if self.is_tty:
            self._draw_bar()
        elif self.clock() - self.last_line >= self.interval_s:
            self.last_line = self.clock()
            say(self.line(), self.file)

    def close(self, rows: int | None = None, output_tokens: int | None = None) -> None:
        """Take the final counts, finish the bar and print the final line (once)."""
        if self.closed:
            return
        if rows is not None:
            self._take(rows, self.tokens if output_tokens is None else output_tokens)
        if self.bar is not None:
            self._draw_bar()
            self.bar.close()
            self._stop_redirect()
        self.closed = True
        if self.enabled:
            say(self.final_line(), self.file)

    # ---- numbers ----------------------------------------------------------------------------------------
    def _take(self, rows: int, output_tokens: int) -> None:
        now = self.clock()
        self.rows = max(self.rows, rows)
        self.total = max(self.total, self.rows)  # per-row n overrides can make the total an underestimate
        self.token_reports += output_tokens > self.tokens
        self.tokens = max(self.tokens, output_tokens)
        if self.tokens and self.first_token_at is None:
            # these tokens were made after the previous report (which had none), not at this instant: a job whose
            # tokens all arrive in one report would otherwise show a rate over a span of microseconds
            self.first_token_at = self.samples[-1][0] if self.samples else self.start
        self.samples.append((now, self.tokens))
        while len(self.samples) > 2 and now - self.samples[0][0] > RATE_WINDOW_S:
            self.samples.popleft()

    def tokens_per_s(self) -> float:
        """Output tokens/s over the last RATE_WINDOW_S seconds (0 before two reports)."""
        if len(self.samples) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self.samples[0], self.samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def average_tokens_per_s(self) -> float:
        """Output tokens/s since the last report before the first token (when this run's tokens started)."""
        if self.first_token_at is None:
            return 0.0
        return self.tokens / max(self.clock() - self.first_token_at, 1e-6)

    def eta_s(self) -> float | None:
        """Seconds left at the row rate since the first token (None before any row of this run)."""
        left = self.total - self.rows
        done_now = self.rows - self.base_rows
        if left <= 0:
            return 0.0
        if done_now <= 0 or self.first_token_at is None:
            return None
        return left * (self.clock() - self.first_token_at) / done_now

    # ---- text -------------------------------------------------------------------------------------------
    def line(self) -> str:
        """A plain progress line for logs."""
        elapsed = self.clock() - self.start
        eta = self.eta_s()
        pct = 100.0 * self.rows / self.total if self.total else 100.0
        return (f"{PREFIX} rows {self.rows}/{self.total} ({pct:.0f}%) | {self.tokens} out tokens, "
                f"{self.tokens_per_s():.1f} out tok/s | elapsed {_duration(elapsed)} | "
                f"ETA {'?' if eta is None else _duration(eta)}")

    def final_line(self) -> str:
        """The last line: where the run ended ('done' when every row is, else 'ended'), with the average rate."""
        elapsed = self.clock() - self.start
        pct = 100.0 * self.rows / self.total if self.total else 100.0
        state = "done" if self.rows >= self.total else "ended"
        if self.token_reports >= 2:
            rate = f"{self.average_tokens_per_s():.1f} out tok/s since the first token"
        else:  # every token came in one report (a tiny job): only the whole run's time is known
            rate = f"{self.tokens / max(elapsed, 1e-6):.1f} out tok/s over the whole run (start-up included)"
        return (f"{PREFIX} {state}: rows {self.rows}/{self.total} ({pct:.0f}%) | {self.tokens} out tokens in this "
                f"run, {rate} | elapsed {_duration(elapsed)}")

    # ---- terminal -----------------------------------------------------------------------------------------
    def _draw_bar(self) -> None:
        if self.bar is None:
            self.bar = tqdm(total=self.total, initial=self.rows, unit="row", file=self.file, dynamic_ncols=True,
                            desc=PREFIX, mininterval=0.2)
            self._start_redirect()
        self.bar.total = self.total
        self.bar.n = self.rows
        eta = self.eta_s()
        self.bar.set_postfix_str(f"{self.tokens_per_s():.1f} out tok/s, ETA "
                                 f"{'?' if eta is None else _duration(eta)}", refresh=False)
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


def _duration(seconds: float) -> str:
    """'42s', '3m05s', '1h02m'."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
