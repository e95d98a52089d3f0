"""Temperature, min-p, top-k and top-p, then a Gumbel-max draw with counter-based noise.

Rows with a top_k take the ``topk`` path: only the ``max(k)`` best candidates are sorted, filtered and raced
(no full-vocabulary sort). Rows without one take the full path (a sort only if some row has top_p < 1). Which
path a row takes depends on its own settings only, and the noise of a candidate is a hash of (row key, token
id), so a row's draw does not depend on the rest of the batch.
"""

from __future__ import annotations

import torch

from jobrunner.engine.sampling import row_argmax, to_device
from jobrunner.engine.sampling.noise import gumbel

TOP_P_CANDIDATES = 1024  # top-p rows look at their best this-many tokens first (see sample_full)


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
    choice = row_argmax(values + gumbel(keys, ids), keepdim=True)
    return ids.gather(1, choice).squeeze(1)


def sample_full(logits: torch.Tensor, temps: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor,
                keys: torch.Tensor, any_top_p: bool = True) -> torch.Tensor:
    """Token ids ``[R]`` for rows without top_k: over the whole vocabulary.

    On CPU, when some row has top_p < 1, rows whose best ``TOP_P_CANDIDATES`` tokens already hold top_p of the
    probability mass draw among those alone (a ``topk``, no sort of the vocabulary, noise for 1k tokens, not
    50k): the tokens top-p keeps all lie among them, so the draw is the same. Whether a row takes that path
    depends on its own logits only, so a seeded row still draws the same whatever it is batched with.
    """
    scaled = apply_min_p(logits / temps[:, None], min_ps)
    if any_top_p and scaled.device.type == "cpu" and scaled.shape[-1] > 4 * TOP_P_CANDIDATES:
        return _sample_top_p_candidates(scaled, top_ps, keys)
    return _draw(_top_p_filter(scaled, top_ps) if any_top_p else scaled, keys)


def _top_p_filter(scaled: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    sorted_scaled, order = scaled.sort(dim=-1, descending=True)
    remove = torch.zeros_like(scaled, dtype=torch.bool).scatter_(1, order, _top_p_remove(sorted_scaled, top_ps))
    return scaled.masked_fill(remove, float("-inf"))


def _draw(scaled: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    vocab_ids = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    return row_argmax(scaled + gumbel(keys, vocab_ids))


def _sample_top_p_candidates(scaled: torch.Tensor, top_ps: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Top-p draws from each row's best TOP_P_CANDIDATES tokens; rows whose candidates hold less than top_p
    of the mass (flat distributions, or top_p = 1) take the full path."""
    values, ids = scaled.topk(TOP_P_CANDIDATES, dim=-1)                    # sorted, best first
    probs = torch.exp(values - torch.logsumexp(scaled, dim=-1, keepdim=True))  # under the full softmax
    covered = probs.sum(dim=-1) >= top_ps
    mass_before = probs.cumsum(dim=-1) - probs
    values = values.masked_fill((mass_before >= top_ps[:, None]) & (top_ps < 1.0)[:, None], float("-inf"))
    picked = ids.gather(1, row_argmax(values + gumbel(keys, ids), keepdim=True)).squeeze(1)
    if not bool(covered.all()):  # a host read: free on CPU, the only device this path runs on
        rest = (~covered).nonzero().flatten()
        picked[rest] = _draw(_top_p_filter(scaled[rest], top_ps[rest]), keys[rest])
    return picked
