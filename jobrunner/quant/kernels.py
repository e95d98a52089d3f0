"""Thin wrappers over torch's own weight-only kernels, with the shape rules each one enforces.

Kernels (torch 2.13 CPU, checked against the installed build; CUDA rules from the tinygemm kernel):

* ``aten._weight_int8pack_mm(x [M, K], w_int8 [N, K], scales [N]) -> [M, N]``: CPU (fast only for bfloat16
  activations) and CUDA (newer builds; probed once, see :func:`has_cuda_int8pack`).
* int4, CPU: ``_convert_weight_to_int4pack_for_cpu(q int32 [N, K], inner_k_tiles)`` -> uint8 [N, K/2] in a
  CPU-capability-specific layout; ``_weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)``.
  Rules: N % 16 == 0, group size in {32, 64, 128, 256}, K % group size == 0.
* int4, CUDA: ``_convert_weight_to_int4pack(q uint8 [N, K/2] (even k in the high nibble), inner_k_tiles)`` ->
  int32 tiles; ``_weight_int4pack_mm(x bf16, packed, group_size, scales_and_zeros)``.
  Rules: bfloat16 activations, N % 8 == 0, K % (16 * inner_k_tiles) == 0, group size in {32, 64, 128, 256}.

``scales_and_zeros`` is [K / group_size, N, 2] in the activation dtype with the tinygemm convention
``w = (q - 8) * scale + zero`` for q in [0, 15].
"""

from __future__ import annotations

import functools

import torch

# CPU: up to this many tokens the packed kernel beats dequantize-then-GEMM (the packed kernels' cost grows
# linearly with the token count). Measured on SmolLM2 shapes, 1 thread (docs/quantization.md): int8 packed
# wins at 8 tokens (532 vs 805 us, gate_up), dequant + bf16 GEMM wins from 16; int4 packed wins up to 64
# tokens (unpacking the nibbles costs ~3-6 ms per gate_up call), unpacking wins from 256 (11.7 vs 21.1 ms).
INT8_KERNEL_MAX_TOKENS = 8
INT4_KERNEL_MAX_TOKENS = 128
INT4_GROUP_SIZES = (32, 64, 128, 256)


@functools.cache
def has_cuda_int8pack() -> bool:
    """Whether ``_weight_int8pack_mm`` runs on CUDA in this torch build (one tiny probe, cached)."""
    if not torch.cuda.is_available():
        return False
    try:
        x = torch.ones(1, 32, device="cuda", dtype=torch.bfloat16)
        w = torch.ones(32, 32, device="cuda", dtype=torch.int8)
        s = torch.ones(32, device="cuda", dtype=torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(x, w, s)
        return bool(torch.allclose(y.float(), torch.full_like(y.float(), 32.0)))
    except (RuntimeError, NotImplementedError):
        return False


def int4_shape_problem(out_features: int, in_features: int, group_size: int,
                       device: torch.device) -> str | None:
    """Why the int4 kernel for ``device`` cannot take this weight shape, or ``None`` when it can."""
    if group_size not in INT4_GROUP_SIZES:
        return f"group size {group_size} not in {INT4_GROUP_SIZES}"
    if in_features % group_size:
        return f"in_features {in_features} is not a multiple of group size {group_size}"
    if device.type == "cuda":
        if out_features % 8:
            return f"out_features {out_features} is not a multiple of 8 (CUDA int4 kernel)"
        if in_features % 32:
            return f"in_features {in_features} is not a multiple of 32 (CUDA int4 kernel)"
        return None
    if out_features % 16:
        return f"out_features {out_features} is not a multiple of 16 (CPU int4 kernel)"
    return None


def cuda_inner_k_tiles(in_features: int) -> int:
    """Largest tinygemm ``inner_k_tiles`` (8, 4 or 2) that divides ``in_features`` into 16-wide tiles."""
    for tiles in (8, 4, 2):
        if in_features % (16 * tiles) == 0:
            return tiles
    raise ValueError(f"in_features {in_features} is not a multiple of 32")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack ``q`` [N, K] (int values 0..15, on the target device) into the device kernel's layout."""
    if q.is_cuda:
        q = q.to(torch.int32)
        nibbles = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
        return torch.ops.aten._convert_weight_to_int4pack(nibbles, cuda_inner_k_tiles(q.shape[1]))
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int,
            scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` times the packed int4 weight, transposed: returns [M, N] in ``x.dtype``."""
    if x.is_cuda:
        return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)
