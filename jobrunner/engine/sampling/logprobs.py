"""Log-probabilities of sampled / prompt tokens and their top-K alternatives, and their token texts.

Values are the model's own distribution: log-softmax of the raw logits (before temperature, penalties, bias
or grammar masks), as vLLM and OpenAI report them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from jobrunner.engine.request import TokenLogprob, TopLogprob

# (token_id, logprob, [(alt_id, alt_logprob), ...]) as it comes off the device
LogprobEntry = tuple[int, float, list[tuple[int, float]]]


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """``[N, 1 + 2k]`` float64: each row's token logprob, then its top-k logprobs, then their ids."""
    chosen = logprobs.gather(1, token_ids[:, None])
    if k == 0:
        return chosen.double()
    top_values, top_ids = logprobs.topk(k, dim=-1)
    return torch.cat([chosen, top_values, top_ids.to(logprobs.dtype)], dim=1).double()


def unpack(token_id: int, row: Sequence[float], k: int, k_max: int) -> LogprobEntry:
    """One row of :func:`gather_logprobs` (computed with ``k_max``) cut to this request's ``k``."""
    alts = [(int(row[1 + k_max + j]), row[1 + j]) for j in range(k)]
    return token_id, row[0], alts


class TokenTexts:
    """Decoded text of single tokens, cached (a top-20 list would otherwise decode 21 tokens per step)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text

    def entry(self, entry: LogprobEntry) -> TokenLogprob:
        token_id, logprob, alts = entry
        return TokenLogprob(token_id, self(token_id), logprob,
                            [TopLogprob(t, self(t), lp) for t, lp in alts])


def prompt_logprob_entries(logits: torch.Tensor, token_ids: Sequence[int], k: int) -> list[LogprobEntry | None]:
    """Entries for every prompt token from ``logits`` ``[T, V]`` (row i predicts token i + 1); first is None."""
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    targets = torch.tensor(list(token_ids[1:]), device=logits.device)
    rows = gather_logprobs(logprobs, targets, k).tolist()
    return [None] + [unpack(t, row, k, k) for t, row in zip(token_ids[1:], rows)]
