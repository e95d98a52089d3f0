"""One driver-side progress display: a tqdm bar on a terminal, periodic plain lines in logs."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm


class Progress:
    """Rows done / total, output tokens/s and ETA; `update` takes absolute counts."""

    def __init__(self, total_rows: int, done_rows: int = 0, file: TextIO | None = None,
                 interval_s: float = 10.0, enabled: bool = True) -> None:
        self.file = file or sys.stderr
        self.total, self.base_rows, self.enabled = total_rows, done_rows, enabled
        self.interval_s = interval_s
        self.start = time.monotonic()
        self.rows, self.tokens, self.last_line = done_rows, 0, 0.0
        is_tty = hasattr(self.file, "isatty") and self.file.isatty()
        self.bar = tqdm(total=total_rows, initial=done_rows, unit="row", file=self.file, dynamic_ncols=True,
                        disable=not enabled) if is_tty else None

    def update(self, rows: int, output_tokens: int) -> None:
        """Set the rows done (all runs) and output tokens generated in this run."""
        self.rows, self.tokens = min(rows, self.total), output_tokens
        if self.bar is not None:
            self.bar.n = self.rows  # absolute: rows of a dead worker's shard may go back to the queue
            self.bar.set_postfix_str(f"{self.tokens_per_s():.1f} out tok/s", refresh=False)
            self.bar.refresh()
        elif self.enabled and time.monotonic() - self.last_line >= self.interval_s:
            self.last_line = time.monotonic()
            print(self.line(), file=self.file, flush=True)

    def tokens_per_s(self) -> float:
        return self.tokens / max(time.monotonic() - self.start, 1e-6)

    def line(self) -> str:
        """A plain progress line for logs."""
        elapsed = time.monotonic() - self.start
        done_now = self.rows - self.base_rows
        left = self.total - self.rows
        eta = "0s" if left <= 0 else f"{left * elapsed / done_now:.0f}s" if done_now > 0 else "?"
        pct = 100.0 * self.rows / self.total if self.total else 100.0
        return (f"[jobrunner] rows {self.rows}/{self.total} ({pct:.0f}%) | "
                f"{self.tokens_per_s():.1f} out tok/s | elapsed {elapsed:.0f}s | ETA {eta}")

    def close(self) -> None:
        """Finish the bar (or print a last line)."""
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(self.line(), file=self.file, flush=True)
