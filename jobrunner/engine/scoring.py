"""Score a whole token sequence in one causal prefill, outside the paged pool (perplexity, agreement checks).

The model runs exactly the layers the engine decodes with, over a private KV buffer just long enough for the
sequence, so scoring never takes blocks from (or disturbs) the requests the engine is serving. The buffer has
the engine's KV-cache dtype (an fp8 cache's scores are those of its quantized keys and values, as its steps'
are: :mod:`jobrunner.attention.kv_quant`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from jobrunner.attention.kv_quant import row_width
from jobrunner.attention.torch_backend import TorchMetadata, _chunk_group

SCORE_BLOCK_SIZE = 16


@torch.inference_mode()
def sequence_logits(model: torch.nn.Module, token_ids: Sequence[int], adapter_id: int = 0,
                    kv_cache_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Float32 logits ``[T, vocab]`` of ``token_ids`` through ``model`` (row i predicts token i + 1), with the
    LoRA adapter ``adapter_id`` of ``model.lora`` (0: the base model), over a KV buffer of ``kv_cache_dtype``
    (default: the model's dtype)."""
    if not token_ids:
        raise ValueError("cannot score an empty sequence")
    s = model.shape
    dev = next(model.parameters()).device
    dtype = model.dtype
    num_tokens = len(token_ids)
    num_blocks = -(-num_tokens // SCORE_BLOCK_SIZE)
    kv_len = num_blocks * SCORE_BLOCK_SIZE
    cache = kv_cache_dtype or dtype
    kv = torch.zeros(s.num_layers, 2, kv_len, s.num_kv_heads, row_width(s.head_dim, cache), device=dev, dtype=cache)
    index = torch.arange(num_tokens, device=dev)
    blocks = torch.arange(num_blocks, device=dev)
    # a chunk starting at position 0: the causal kernel, no mask (a masked group past a sliding window); one
    # group per distinct window where layers differ (Gemma 2/3), each layer taking its own (for_layer)
    windows = s.layer_windows or (s.sliding_window,)
    by_window = {w: TorchMetadata(index, [_chunk_group(0, num_tokens, num_tokens, blocks, SCORE_BLOCK_SIZE, dev, w)],
                                  num_tokens, SCORE_BLOCK_SIZE) for w in set(windows)}
    meta = by_window[windows[0]]
    meta.layer_views = [by_window[w] for w in windows] if s.layer_windows else None
    ids = torch.tensor(list(token_ids), device=dev)
    rotary = model.rotary
    positions = index + rotary.table_offset(1) if rotary.uses_long_table(num_tokens) else index  # longrope
    if adapter_id:
        with model.lora.step([(adapter_id, slice(0, num_tokens))]):
            return model.compute_logits(model(ids, positions, meta, kv)).float()
    return model.compute_logits(model(ids, positions, meta, kv)).float()
