"""Verify drafted tokens: score every draft position in one step, keep the longest prefix the target agrees with.

A row with drafts ``d_0 .. d_{k-1}`` was run as ``1 + k`` query tokens (its pending token, then the drafts), so
the step has ``1 + k`` next-token distributions for it: position ``j`` is the target's distribution after
``d_0 .. d_{j-1}``. Each position is sampled exactly as a plain decode step would sample it — the same
sampler, on a view of the request whose output already holds ``d_0 .. d_{j-1}`` (so penalties, ``min_tokens``,
logit bias, temperature / top-k / top-p / min-p and the counter-based noise of that output position all see
the same state as without speculation), giving targets ``t_0 .. t_k``. The row keeps ``t_0 .. t_m`` where
``m`` is the first position whose draft differs from its target (``m = k`` when all match).

Why this is exact. Greedy: ``t_j`` is the argmax, so the output is token for token the output without
speculation. Sampled: for a deterministic draft (n-gram lookup proposes ``d_j`` with probability 1), standard
speculative rejection sampling accepts ``d_j`` with probability ``min(1, p(d_j) / 1) = p(d_j)`` and on
rejection draws from the residual ``max(0, p - onehot(d_j))``, i.e. ``p`` without ``d_j``, renormalized.
Drawing ``t_j ~ p`` and accepting iff ``t_j == d_j`` is that same procedure (accepted with probability
``p(d_j)``; given a rejection ``t_j`` is distributed as ``p`` conditioned on ``t_j != d_j``: the residual) —
and because ``t_j`` is the draw a plain step would make from the same (seed, output position) noise, a seeded
request gives the same tokens with speculation on or off (up to floating-point differences of the batched
forward pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jobrunner.engine.sampling.logprobs import LogprobEntry


@dataclass
class VerifiedDraft:
    """The outcome of one row's drafts: ``tokens`` = ``t_0 .. t_m`` (accepted drafts then the target's token)."""

    tokens: list[int]
    logprobs: list[LogprobEntry | None]
    num_drafted: int

    @property
    def num_accepted(self) -> int:
        return len(self.tokens) - 1


class DraftView:
    """A request as it would be with ``extra`` tokens already generated (what the sampler reads of it)."""

    def __init__(self, request, extra: list[int]) -> None:
        self._request = request
        self.output_token_ids = request.output_token_ids + extra
        self.num_output_tokens = len(self.output_token_ids)
        self.num_tokens = request.num_prompt_tokens + self.num_output_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self._request.prompt_token_ids + self.output_token_ids

    def __getattr__(self, name: str):  # everything else (params, seed, key, prompt, eos ids) is the request's
        return getattr(self._request, name)


def accepted_length(draft: list[int], targets: list[int]) -> int:
    """How many leading drafts equal the target's tokens at their positions."""
    m = 0
    while m < len(draft) and draft[m] == targets[m]:
        m += 1
    return m


def verify_drafts(model: torch.nn.Module, sampler, hidden: torch.Tensor, sample_rows: torch.Tensor, sampling: list):
    """Sample every row of a step that has speculative rows; returns ``(sampled, logprobs, verified)``.

    ``sample_rows`` holds one flat index per plain sampling row and ``1 + k`` per row with ``k`` drafts (in
    ``sampling`` order); ``sampled`` / ``logprobs`` get each row's first token as usual, ``verified`` maps the
    speculative rows' ``Request.key`` to their :class:`VerifiedDraft`.
    """
    logits = model.compute_logits(hidden.index_select(0, sample_rows))
    views = []
    for s in sampling:
        views.append(s.request)
        views.extend(DraftView(s.request, s.draft[:j]) for j in range(1, len(s.draft) + 1))
    out = sampler.sample(logits, views)
    sampled, logprobs, verified = {}, {}, {}
    i = 0
    for s in sampling:
        key, k = s.request.key, len(s.draft)
        targets, entries = out.token_ids[i:i + k + 1], out.logprobs[i:i + k + 1]
        i += k + 1
        sampled[key] = targets[0]
        if entries[0] is not None:
            logprobs[key] = entries[0]
        if k:
            m = accepted_length(s.draft, targets)
            verified[key] = VerifiedDraft(targets[:m + 1], entries[:m + 1], k)
    return sampled, logprobs, verified
