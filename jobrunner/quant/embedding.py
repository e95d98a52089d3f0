"""Int8 per-row embedding, so quantized models don't keep their (often largest) table in float.

A row of the embedding table is an output channel of a tied ``lm_head``, so the int8 ``lm_head`` and the
embedding can share one tensor: :meth:`Int8Embedding.from_int8_linear` does exactly that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jobrunner.quant.int8 import Int8WeightOnlyLinear, quantize_int8_per_channel


class Int8Embedding(torch.nn.Module):
    """Drop-in replacement for ``nn.Embedding`` (lookup only) over int8 rows with one float32 scale each."""

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scales", scales)
        self.out_dtype = out_dtype

    @classmethod
    def from_embedding(cls, embedding: torch.nn.Embedding) -> Int8Embedding:
        """Quantize ``embedding`` row by row (same per-channel rule as the int8 linear)."""
        q, scales = quantize_int8_per_channel(embedding.weight)
        return cls(q, scales, embedding.weight.dtype)

    @classmethod
    def from_int8_linear(cls, linear: Int8WeightOnlyLinear, out_dtype: torch.dtype) -> Int8Embedding:
        """Share the int8 weight and scales of a tied ``lm_head`` (no extra memory)."""
        return cls(linear.weight_int8, linear.scales, out_dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [...] -> [..., embedding_dim]
        rows = F.embedding(input_ids, self.weight_int8).to(torch.float32)
        return (rows * self.scales[input_ids].unsqueeze(-1)).to(self.out_dtype)

    def weight_bytes(self) -> int:
        """Bytes of the int8 table and its scales."""
        return self.weight_int8.numel() + self.scales.numel() * self.scales.element_size()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, out_dtype={self.out_dtype}"
