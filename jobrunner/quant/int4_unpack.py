"""Read back the CPU int4 kernel's packed weight, for the dequantize-then-GEMM path at large token counts.

``_convert_weight_to_int4pack_for_cpu`` stores N in blocks of ``block_n`` rows (64 with AVX512, 32 otherwise),
each block as [K, block_n / 2] bytes. Vectorized builds put rows ``[0, block_n/2)`` in the low nibbles and the
rest in the high nibbles ("split"); a partial last block, and scalar builds, interleave rows (row 2j low,
2j+1 high). This layout is torch's internal business, so :func:`find_cpu_unpacker` tries the known layouts on
the actual weight and only returns one that reproduces it exactly; otherwise the layer keeps the packed
kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LAYOUTS = ((64, True), (32, True), (32, False))


def _split(block: torch.Tensor) -> torch.Tensor:
    # block: [num_blocks, K, block_n / 2] -> [num_blocks, K, block_n]
    return torch.cat([block & 15, block >> 4], dim=-1)


def _interleave(block: torch.Tensor) -> torch.Tensor:
    return torch.stack([block & 15, block >> 4], dim=-1).flatten(-2)


def unpack_cpu_int4(packed: torch.Tensor, out_features: int, in_features: int, block_n: int,
                    is_split: bool) -> torch.Tensor:
    """Unpack a CPU-packed int4 weight (given its layout) to uint8 [out_features, in_features] in 0..15."""
    flat = packed.reshape(-1)
    num_full = out_features // block_n
    tail_n = out_features - num_full * block_n
    cut = num_full * in_features * block_n // 2
    parts = []
    if num_full:
        full = flat[:cut].view(num_full, in_features, block_n // 2)
        full = _split(full) if is_split else _interleave(full)
        parts.append(full.transpose(1, 2).reshape(num_full * block_n, in_features))
    if tail_n:
        tail = _interleave(flat[cut:].view(1, in_features, tail_n // 2))
        parts.append(tail[0].t())
    return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0].contiguous()


def find_cpu_unpacker(packed: torch.Tensor, q: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A function ``packed -> q`` (uint8 [N, K]) reproducing ``q`` exactly, or ``None`` if no layout fits."""
    out_features, in_features = q.shape
    expected = q.to(torch.uint8)
    for block_n, is_split in _LAYOUTS:
        try:
            got = unpack_cpu_int4(packed, out_features, in_features, block_n, is_split)
        except RuntimeError:
            continue
        if got.shape == expected.shape and torch.equal(got, expected):
            return lambda p, b=block_n, s=is_split: unpack_cpu_int4(p, out_features, in_features, b, s)
    return None
