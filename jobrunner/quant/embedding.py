"""Quantized embeddings, so quantized models don't keep their (often largest) table in float.

A row of the embedding table is an output channel of a tied ``lm_head``, so the quantized head and the
embedding can share one tensor: :meth:`Int8Embedding.from_int8_linear` for int8, :class:`Int4SharedEmbedding`
for int4 on CPU (where we can read the packed layout). Otherwise the embedding gets its own int8 rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jobrunner.quant.int4 import Int4WeightOnlyLinear
from jobrunner.quant.int8 import Int8WeightOnlyLinear
from jobrunner.quant.primitives import dequantize_int4, dequantize_int8, quantize_int8_per_channel


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
        """Share the int8 weight and scales of a tied ``lm_head`` (no extra memory; a W8A8 head that holds only
        its packed weight gives its codes back as a new tensor)."""
        codes = linear.weight_int8 if linear.weight_int8 is not None else linear.codes()
        return cls(codes, linear.scales, out_dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized table [num_embeddings, dim] (built on each access: for ``.dtype``-style probes)."""
        return dequantize_int8(self.weight_int8, self.scales, self.out_dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [...] -> [..., embedding_dim]
        rows = F.embedding(input_ids, self.weight_int8).to(torch.float32)
        return (rows * self.scales[input_ids].unsqueeze(-1)).to(self.out_dtype)

    def weight_bytes(self) -> int:
        """Bytes of the int8 table and its scales."""
        return self.weight_int8.numel() + self.scales.numel() * self.scales.element_size()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, out_dtype={self.out_dtype}"


class Int4SharedEmbedding(torch.nn.Module):
    """Embedding lookups read straight from a tied int4 ``lm_head`` (CPU layout), so the table is stored once.

    Each looked-up row is unpacked from the kernel's packed weight and dequantized with its group scales.
    """

    def __init__(self, head: Int4WeightOnlyLinear, out_dtype: torch.dtype) -> None:
        super().__init__()
        if head.cpu_layout is None:
            raise ValueError("the int4 head has no readable CPU layout; use Int8Embedding instead")
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.group_size = head.group_size
        self.layout = head.cpu_layout
        self.register_buffer("weight_int4pack", head.weight_int4pack)  # the same tensors as the head's
        self.register_buffer("scales_and_zeros", head.scales_and_zeros)
        self.out_dtype = out_dtype

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized table [num_embeddings, dim] (built on each access: for ``.dtype``-style probes)."""
        return self(torch.arange(self.num_embeddings, device=self.weight_int4pack.device))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [...] -> [..., embedding_dim]
        flat = input_ids.reshape(-1)
        q = self.layout.gather_rows(self.weight_int4pack, flat)  # [T, K]
        rows = dequantize_int4(q, self.scales_and_zeros[:, flat, :], self.group_size, torch.float32)
        return rows.reshape(*input_ids.shape, self.embedding_dim).to(self.out_dtype)

    def weight_bytes(self) -> int:
        """Zero: the table is the head's weight."""
        return 0

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, shared int4, out_dtype={self.out_dtype}"
