"""Short multi-token rows past position 0 (speculative verification: 1 + k tokens) packed into shared groups.

Without this each such row would be its own chunk group: one ``scaled_dot_product_attention`` call per row per
layer. Rows with the same query length ``Q`` (2 .. ``MAX_SHORT_QUERY``) are packed by context length like
single-token decodes, and a group's mask ``[G, 1, Q, L]`` lets query ``q`` of a row starting at ``start`` see
keys ``0 .. start + q`` (causal within the row's new tokens). Rows under a sliding window keep the chunk path.
"""

from __future__ import annotations

import torch

MAX_SHORT_QUERY = 17  # 1 + the most draft tokens per row (EngineConfig.num_speculative_tokens <= 16)


def is_short_row(query_len: int, seq_len: int, window: int | None) -> bool:
    """Whether a row takes the packed short-row path."""
    return 1 < query_len <= MAX_SHORT_QUERY and seq_len > query_len and window is None


def short_row_index(offsets: torch.Tensor, query_len: int) -> torch.Tensor:
    """Flat token index ``[G * Q]`` of every query of a group (rows start at ``offsets``)."""
    return (offsets[:, None] + torch.arange(query_len, device=offsets.device)[None, :]).reshape(-1)


def short_row_mask(lengths: torch.Tensor, query_len: int, kv_len: int) -> torch.Tensor:
    """``[G, 1, Q, L]`` True where query q of a row with context ``length`` may see the key."""
    device = lengths.device
    last_visible = lengths[:, None] - query_len + torch.arange(query_len, device=device)[None, :]  # [G, Q]
    keys = torch.arange(kv_len, device=device)
    return (keys[None, None, :] <= last_visible[:, :, None])[:, None]
