"""Prompt-lookup (n-gram) drafts: continue the sequence the way it continued after the last time its tail occurred.

For a request with tokens ``x_0 .. x_{L-1}`` (prompt + output so far), try ``n`` from ``max_n`` down to
``min_n``: find the most recent earlier position where the last ``n`` tokens occurred, and propose the (up to
``k``) tokens that followed there. Copying workloads (rewriting, extraction, summaries that quote) repeat long
runs of the prompt, so the drafts are often right; open chat rarely matches.

Each request keeps an index ``n-gram -> end position of its latest occurrence`` that grows with the tokens
(:class:`NgramIndex`), so a proposal costs a few dictionary operations per new token, not a scan.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NgramIndex:
    """Latest end position of every n-gram (``min_n <= n <= max_n``) ending before ``indexed`` tokens."""

    max_n: int
    min_n: int
    indexed: int = 0  # n-grams ending at positions < indexed are in the tables
    tables: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)

    def extend(self, tokens: list[int], upto: int) -> None:
        """Index the n-grams ending at positions ``indexed .. upto - 1``."""
        for end in range(self.indexed, upto):
            for n in range(self.min_n, self.max_n + 1):
                if end + 1 >= n:
                    self.tables.setdefault(n, {})[tuple(tokens[end + 1 - n:end + 1])] = end
        self.indexed = max(self.indexed, upto)

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Up to ``k`` draft tokens after ``tokens`` and the n of the match (``([], 0)`` when none)."""
        length = len(tokens)
        self.extend(tokens, length - 1)  # never the tail itself: it would match itself
        draft, matched = [], 0
        for n in range(self.max_n, self.min_n - 1, -1):
            if length < n + 1:
                continue
            end = self.tables.get(n, {}).get(tuple(tokens[length - n:]))
            if end is not None:
                draft, matched = tokens[end + 1:end + 1 + k], n
                break
        self.extend(tokens, length)
        return draft, matched
