"""Temperature, min-p, top-k and top-p, then a Gumbel-max draw with counter-based noise.

Rows with a top_k take the ``topk`` path: only the ``max(k)`` best candidates are sorted, filtered and raced
(no full-vocabulary sort). Rows without one take the full path (a sort only if some row has top_p < 1). Which
path a row takes depends on its own settings only, and the noise of a candidate is a hash of (row key, token
id), so a row's draw does not depend on the rest of the batch.
"""

from __future__ import annotations

import torch

from jobrunner.engine.sampling import to_device
from jobrunner.engine.sampling.noise import gumbel


def _min_p_floor(scaled_max: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    # p >= min_p * p_max  <=>  logit / T >= max / T + log(min_p)   (min_p = 0 -> -inf: keep all)
    return scaled_max + torch.log(min_ps)


def _top_p_remove(sorted_scaled: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    # drop a token once the mass *before* it already reaches top_p (the best token always stays)
    probs = torch.softmax(sorted_scaled, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # rows with top_p = 1 keep everything (a float cumsum may reach 1 before the last token)
    return (mass_before >= top_ps[:, None]) & (top_ps < 1.0)[:, None]


def apply_min_p(scaled: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """``scaled`` ``[R, V]`` (logits / T) with tokens below ``min_p * p_max`` set to ``-inf``."""
    return scaled.masked_fill(scaled < _min_p_floor(scaled.amax(dim=-1, keepdim=True), min_ps[:, None]),
                              float("-inf"))


def filter_top_k(scaled: torch.Tensor, top_ks: list[int], top_ps: torch.Tensor, min_ps: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates of rows that all have 0 < top_k: ``(values, token_ids)`` ``[R, max k]``, removed = -inf.

    Only ``topk`` sorts (the best ``max(k)``), never the whole vocabulary.
    """
    k_max = min(max(top_ks), scaled.shape[-1])
    values, ids = scaled.topk(k_max, dim=-1)                      # sorted, best first
    ks = to_device(top_ks, scaled.device, torch.int64)[:, None]
    remove = torch.arange(k_max, device=scaled.device)[None, :] >= ks
    remove |= values < _min_p_floor(values[:, :1], min_ps[:, None])
    values = values.masked_fill(remove, float("-inf"))
    return values.masked_fill(_top_p_remove(values, top_ps), float("-inf")), ids


def filter_full(scaled: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor, any_top_p: bool = True
                ) -> torch.Tensor:
    """Rows without top_k: min-p, then top-p (one sort; skipped when the caller knows no row has top_p < 1,
    a host-side fact, so no device->host sync)."""
    scaled = apply_min_p(scaled, min_ps)
    if any_top_p:
        sorted_scaled, order = scaled.sort(dim=-1, descending=True)
        remove = torch.zeros_like(scaled, dtype=torch.bool).scatter_(1, order, _top_p_remove(sorted_scaled, top_ps))
        scaled = scaled.masked_fill(remove, float("-inf"))
    return scaled


def sample_top_k(logits: torch.Tensor, temps: torch.Tensor, top_ks: list[int], top_ps: torch.Tensor,
                 min_ps: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Token ids ``[R]`` for rows that all have 0 < top_k."""
    values, ids = filter_top_k(logits / temps[:, None], top_ks, top_ps, min_ps)
    choice = (values + gumbel(keys, ids)).argmax(dim=-1, keepdim=True)
    return ids.gather(1, choice).squeeze(1)


def sample_full(logits: torch.Tensor, temps: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor,
                keys: torch.Tensor, any_top_p: bool = True) -> torch.Tensor:
    """Token ids ``[R]`` for rows without top_k: over the whole vocabulary."""
    scaled = filter_full(logits / temps[:, None], top_ps, min_ps, any_top_p)
    vocab_ids = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    return (scaled + gumbel(keys, vocab_ids)).argmax(dim=-1)
