"""When speculation pays: measured acceptance per n-gram length, a fitted step-cost line, a greedy plan.

A step that runs ``X`` query tokens costs about ``c0 + c1 * X`` seconds (:class:`StepCost`, fitted on the
engine's own decode steps; only ``r = c0 / c1``, the fixed cost in tokens, matters). A step of ``D`` decoding
rows yields ``D`` tokens; a draft token at depth ``i`` of a row whose match had length ``n`` adds one more
token with probability ``alpha[n] ** i`` (``alpha``: the measured chance that a draft token is accepted given
the ones before it were, :class:`Acceptance`). Adding draft tokens in order of that probability improves
tokens per second while ``p > Y / (r + X)`` (``Y`` expected tokens, ``X`` query tokens so far) — so at batch 1
on a weight-bound step almost any likely draft is worth it, and at full batch only near-certain ones are
(usually none): speculation turns itself on in the drain tail and off at full batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# The fixed cost of a step in tokens (c0 / c1) until the engine has timed steps of different sizes. CPU: measured
# with scripts/speculative_bench.py (a one-off, at commit a75bf8c) on SmolLM2-135M (2-core Zen 4, bf16); CUDA: an
# unmeasured guess (decode is weight-bound there far beyond these batch sizes).
PRIOR_FIXED_TOKENS = {"cpu": 16.0, "cuda": 256.0}
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 4.0        # the prior counts as this many evaluated draft tokens
ACCEPTANCE_WINDOW = 4096  # evaluated tokens per n-gram length before old counts are halved
MARGIN = 0.1              # a draft token must beat the break-even probability by this share


@dataclass
class Acceptance:
    """Per match length n, draft tokens evaluated and accepted, apart for a draft's first token and its later ones.

    A later token is evaluated only when the ones before it were accepted; splitting the two matters because
    acceptance is bursty: on chat most first tokens miss while a draft that starts right (a repetition, a
    quote) usually goes on right, so one pooled rate overstates the first token and understates the rest.
    """

    evaluated: dict[tuple[int, bool], float] = field(default_factory=dict)
    accepted: dict[tuple[int, bool], float] = field(default_factory=dict)

    def record(self, n: int, first: bool, evaluated: int, accepted: int) -> None:
        key = (n, first)
        e = self.evaluated.get(key, 0.0) + evaluated
        a = self.accepted.get(key, 0.0) + accepted
        if e > ACCEPTANCE_WINDOW:  # forget slowly: a workload's later rows may copy more or less
            e, a = e / 2, a / 2
        self.evaluated[key], self.accepted[key] = e, a

    def record_draft(self, n: int, num_drafted: int, num_accepted: int) -> None:
        """One verified draft of ``num_drafted`` tokens whose first ``num_accepted`` were accepted."""
        self.record(n, True, 1, int(num_accepted > 0))
        if num_drafted > 1 and num_accepted > 0:
            self.record(n, False, min(num_accepted, num_drafted - 1), num_accepted - 1)

    def rate(self, n: int, first: bool) -> float:
        key = (n, first)
        return ((self.accepted.get(key, 0.0) + PRIOR_WEIGHT * PRIOR_ACCEPTANCE)
                / (self.evaluated.get(key, 0.0) + PRIOR_WEIGHT))

    def alpha(self, n: int) -> tuple[float, float]:
        """(chance the first draft token is accepted, chance a later one is given the ones before were)."""
        return self.rate(n, True), self.rate(n, False)

    def lengths(self) -> list[int]:
        return sorted({n for n, _ in self.evaluated})


class StepCost:
    """Seconds per decode-only step against its query tokens, fitted as a line near the step size asked about.

    A CPU or GPU step is weight-bound at a few rows (extra tokens are nearly free) and compute-bound at many
    (each costs about as much as a row), so one line over all sizes is wrong at both ends: ``fixed_tokens(x)``
    fits ``c0 + c1 * tokens`` over the latest steps of ``x / 2 .. 2 x`` tokens only, capped by the fit over all
    sizes (the two must agree that drafts are cheap: a step time is noisy on a shared machine).
    """

    def __init__(self, prior_fixed_tokens: float, window: int = 512) -> None:
        self.prior = prior_fixed_tokens
        self.points: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, num_tokens: int, seconds: float) -> None:
        self.points.append((num_tokens, seconds))

    def fixed_tokens(self, num_tokens: int | None = None) -> float:
        """``c0 / c1`` near ``num_tokens``, at most the fit over all sizes (a few noisy steps near one size must
        not make drafts look free at full batch); the prior until the steps span enough sizes."""
        overall = self._fit(list(self.points))
        if num_tokens is None:
            return overall
        return min(overall, self._fit([p for p in self.points if num_tokens / 2 <= p[0] <= 2 * num_tokens + 1]))

    def _fit(self, pts: list[tuple[int, float]]) -> float:
        if len(pts) < 8:
            return self.prior
        xs = [p[0] for p in pts]
        if max(xs) < 1.5 * min(xs):
            return self.prior
        n = len(pts)
        mx, my = sum(xs) / n, sum(p[1] for p in pts) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        c1 = sum((x - mx) * (y - my) for x, y in pts) / sxx
        c0 = my - c1 * mx
        if c1 <= 0:
            return self.prior
        return min(max(c0 / c1, 0.5), 4096.0)


def plan_drafts(alphas: list[tuple[float, float]], lengths: list[int], num_decoding: int, num_tokens: int,
                fixed_tokens: float) -> list[int]:
    """Draft tokens to verify per candidate row (0 = none) so that expected tokens per second grows.

    ``alphas[i]``: (first-token, later-token) acceptance of candidate row i; ``lengths[i]``: its available draft
    length; ``num_decoding``: rows that sample this step; ``num_tokens``: query tokens of the step without drafts.
    The token at depth ``d`` is accepted with probability ``first * later ** (d - 1)``.
    """
    candidates = sorted(((a1 * a2 ** (i - 1), i, r) for r, (a1, a2) in enumerate(alphas)
                         for i in range(1, lengths[r] + 1)), key=lambda c: (-c[0], c[1]))
    ks = [0] * len(alphas)
    expected, cost = float(num_decoding), fixed_tokens + num_tokens
    for p, depth, r in candidates:
        if depth != ks[r] + 1:  # a row's depths are taken in order (their probabilities only fall)
            continue
        if p <= (1.0 + MARGIN) * expected / cost:
            break
        ks[r] = depth
        expected += p
        cost += 1
    return ks
