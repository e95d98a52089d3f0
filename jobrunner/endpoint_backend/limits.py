"""Requests-per-minute and tokens-per-minute budgets over a sliding window.

Every send is written in a log (its time and its tokens). A send may go when the log's requests + 1 stay
within the requests budget and its tokens + the send's estimate within the tokens budget, counting every send
the server has had for less than `window_s` seconds: from when its bytes were written plus a margin for the
network (`seen_by`; a send not yet written counts until it is), so no window of `window_s` seconds as the
server counts ever holds more than the budgets. Held to that alone, a run would send a whole minute's budget
at its first instant and then wait; so a second rule spreads the sends: over a short window (`window_s /
spread`, counted from the sends) the budgets divided by `spread` (rounded up). A send that alone is larger
than the short window's token share may go when that window is empty (it would never fit otherwise).

A 429 gives its entry back (the server says it did not take the request); the usage the server reports
replaces the estimate, so later sends see the tokens really spent.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

WINDOW_S = 60.0
SPREAD = 6  # the short window is a sixth of the minute (10 s), holding a sixth of each budget


@dataclass(eq=False)
class Grant:
    """One send in the log: when it went and the tokens it is counted for."""

    time: float
    tokens: float
    live: bool = True  # False once given back (a 429)
    seen_by: float | None = None  # by when the server has it (written + a margin); None until written


class _Window:
    """The sends of the last `length_s` seconds, and the budgets they must stay within."""

    def __init__(self, length_s: float, max_requests: float | None, max_tokens: float | None,
                 from_answers: bool) -> None:
        self.length_s, self.max_requests, self.max_tokens = length_s, max_requests, max_tokens
        self.from_answers = from_answers  # a send counts until length_s after `seen_by` (else its send)
        self.log: deque[Grant] = deque()

    def _since(self, grant: Grant) -> float:
        if not self.from_answers:
            return grant.time
        return grant.seen_by if grant.seen_by is not None else float("inf")

    def wait_s(self, tokens: float, now: float, alone_may_pass: bool) -> float:
        """0 when a send of `tokens` fits now, else the seconds until enough of the log has left the window."""
        while self.log and (not self.log[0].live or self._since(self.log[0]) <= now - self.length_s):
            self.log.popleft()
        live = sorted((g for g in self.log if g.live and self._since(g) > now - self.length_s), key=self._since)
        waits = [0.0]
        if self.max_requests is not None and len(live) + 1 > self.max_requests:
            over = len(live) + 1 - int(self.max_requests)  # this many oldest sends must leave first
            waits.append(self._since(live[over - 1]) + self.length_s - now)
        if self.max_tokens is not None and live:
            used = sum(g.tokens for g in live)
            if used + tokens > self.max_tokens:
                for grant in live:  # oldest first: after it leaves, is there room?
                    used -= grant.tokens
                    if used + tokens <= self.max_tokens or (alone_may_pass and used <= 0):
                        break
                waits.append(self._since(grant) + self.length_s - now)
        return max(waits)


class RateLimiter:
    """The requests and tokens budgets of one worker's sends (either may be None: no limit)."""

    def __init__(self, requests_per_minute: float | None, tokens_per_minute: float | None,
                 window_s: float = WINDOW_S, spread: int = SPREAD) -> None:
        self.requests_per_minute, self.tokens_per_minute = requests_per_minute, tokens_per_minute
        short = (None if requests_per_minute is None else math.ceil(requests_per_minute / spread),
                 None if tokens_per_minute is None else tokens_per_minute / spread)
        self._windows = [(_Window(window_s, requests_per_minute, tokens_per_minute, True), False),
                         (_Window(window_s / spread, *short, False), True)]

    def never_fits(self, tokens: float) -> str | None:
        """Why a send of `tokens` can never go (more than a whole minute's tokens), or None."""
        if self.tokens_per_minute is not None and tokens > self.tokens_per_minute:
            return (f"the request counts {tokens:.0f} tokens (prompt estimate + max_tokens x n), more than "
                    f"engine.endpoint.tokens_per_minute={self.tokens_per_minute:g}")
        return None

    def wait_s(self, tokens: float, now: float) -> float:
        """0 when a send of `tokens` may go now, else how long until it may (budgets allowing)."""
        return max(w.wait_s(tokens, now, alone) for w, alone in self._windows)

    def take(self, tokens: float, now: float) -> Grant:
        """Log a send of `tokens` now (after `wait_s` said 0)."""
        grant = Grant(now, float(tokens))
        for window, _ in self._windows:
            window.log.append(grant)
        return grant

    def seen_by(self, grant: Grant, when: float) -> None:
        """The server has the send by `when` (its bytes written, plus the network's margin; or it failed)."""
        if grant.seen_by is None:
            grant.seen_by = when

    def give_back(self, grant: Grant) -> None:
        """The server did not take the request (429): it no longer counts."""
        grant.live = False

    def correct(self, grant: Grant, tokens: float) -> None:
        """The server's usage for the request: it counts these tokens, not the estimate."""
        grant.tokens = float(tokens)
