"""Thin wrappers over torch's own weight-only kernels, with the shape rules each one enforces.

Kernels (torch 2.13 CPU, checked against the installed build; CUDA rules from the tinygemm kernel):

* ``aten._weight_int8pack_mm(x [M, K], w_int8 [N, K], scales [N]) -> [M, N]``: CPU (fast only for bfloat16
  activations) and CUDA (newer builds; probed once, see :func:`has_cuda_int8pack`).
* int4, CPU: ``_convert_weight_to_int4pack_for_cpu(q int32 [N, K], inner_k_tiles)`` -> uint8 [N, K/2] in a
  CPU-capability-specific layout; ``_weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)``.
  Rules: N % 16 == 0, group size in {32, 64, 128, 256}, K % group size == 0.
* ``torch._int_mm(a int8 [M, K], b int8 [K, N]) -> int32``: W8A8, used on CUDA builds without
  ``_weight_int8pack_mm`` (needs M > 16 and K, N multiples of 8: rows are padded).
* int4, CUDA: ``_convert_weight_to_int4pack(q uint8 [N, K/2] (even k in the high nibble), inner_k_tiles)`` ->
  int32 tiles; ``_weight_int4pack_mm(x bf16, packed, group_size, scales_and_zeros)``.
  Rules: bfloat16 activations, N % 8 == 0, K % (16 * inner_k_tiles) == 0, group size in {32, 64, 128, 256}.

``scales_and_zeros`` is [K / group_size, N, 2] in the activation dtype with the tinygemm convention
``w = (q - 8) * scale + zero`` for q in [0, 15].
"""

from __future__ import annotations

import functools

import torch

from jobrunner.quant.primitives import row_chunks

# Which kernel runs for how many tokens is decided per machine in jobrunner.quant.dispatch.
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
    # CPU: the packed rows of a 64-row block depend on those rows alone, so pack by blocks of rows (int32
    # copies of a chunk, not of the whole weight: a streamed quantized load keeps its peak near the layer)
    parts = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(q[rows].to(torch.int32).contiguous(), 2)
             for rows in row_chunks(*q.shape)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int,
            scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` times the packed int4 weight, transposed: returns [M, N] in ``x.dtype``."""
    if x.is_cuda:
        return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)


def int8_int_mm(x: torch.Tensor, weight_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """W8A8: ``x [M, K]`` quantized per token (symmetric int8), times ``weight_int8 [N, K]``; float32 [M, N].

    ``torch._int_mm`` wants more than 16 rows (and a multiple of 8), so small batches are zero-padded.
    """
    m = x.shape[0]
    xf = x.float()
    x_scale = (xf.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
    xq = torch.round(xf / x_scale).clamp(-127, 127).to(torch.int8)
    rows = max(24, -(-m // 8) * 8)
    if rows != m:
        xq = torch.nn.functional.pad(xq, (0, 0, 0, rows - m))
    acc = torch._int_mm(xq, weight_int8.t())[:m]
    return acc.float() * x_scale * scales[None, :]


@functools.cache
def _tinygemm_order(inner_k_tiles: int) -> torch.Tensor:
    """For one (8 rows x 16 * inner_k_tiles columns) super-tile of the CUDA int4 layout: the position of each
    nibble (in [lane 32][inner_k_tiles / 2][nibble 8] order) as ``row * (16 * inner_k_tiles) + col``.

    Written from ``matrix_to_m16n8k16_Bint4_layout`` (aten/src/ATen/native/cuda/int4mm.cu, NVIDIA path): lane
    t holds row ``t // 4``; pair h of k-tiles starts at byte ``16 h`` of that row; its int32 holds the high
    nibbles (even k) of bytes ``t%4, t%4+4, 8+t%4, 12+t%4`` in nibbles 0..3 and their low nibbles (odd k) in
    nibbles 4..7. :func:`unpack_int4_cuda` checks it against the real weight at load time.
    """
    width = 16 * inner_k_tiles
    order = []
    for t in range(32):
        for h in range(inner_k_tiles // 2):
            offsets = (t % 4, t % 4 + 4, 8 + t % 4, 12 + t % 4)
            for j in range(8):
                byte = 16 * h + offsets[j % 4]
                k = 2 * byte + (0 if j < 4 else 1)
                order.append((t // 4) * width + k)
    return torch.tensor(order, dtype=torch.int64)


def pack_int4_cuda_reference(q: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """The CUDA layout built with torch ops on any device (the test oracle for :func:`unpack_int4_cuda`)."""
    n, k = q.shape
    width = 16 * inner_k_tiles
    tiles = q.to(torch.int64).reshape(n // 8, 8, k // width, width).permute(0, 2, 1, 3)
    nib = tiles.reshape(n // 8, k // width, -1)[:, :, _tinygemm_order(inner_k_tiles).to(q.device)]
    nib = nib.reshape(n // 8, k // width, 32, inner_k_tiles // 2, 8)
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    word = (nib << shifts).sum(-1)  # 0 .. 2^32 - 1
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_int4_cuda(packed: torch.Tensor, n0_tile: int = 0, n1_tile: int | None = None) -> torch.Tensor:
    """Codes (0..15, uint8) of rows ``[8 * n0_tile, 8 * n1_tile)`` of a CUDA-packed int4 weight."""
    part = packed[n0_tile:n1_tile]
    n_tiles, k_super, _, half = part.shape
    width = 32 * half
    shifts = torch.arange(0, 32, 4, device=part.device, dtype=torch.int32)
    nib = ((part.unsqueeze(-1) >> shifts) & 15).to(torch.uint8).reshape(n_tiles, k_super, -1)
    inverse = _tinygemm_inverse(2 * half, part.device)
    codes = nib[:, :, inverse].reshape(n_tiles, k_super, 8, width)
    return codes.permute(0, 2, 1, 3).reshape(n_tiles * 8, k_super * width)


@functools.cache
def _tinygemm_inverse(inner_k_tiles: int, device: torch.device) -> torch.Tensor:
    # Cached per device: built (host -> device copy) when a layer is created, never inside a graph capture.
    return torch.argsort(_tinygemm_order(inner_k_tiles)).to(device)


def int_mm_shape_ok(out_features: int, in_features: int) -> bool:
    """Whether ``torch._int_mm`` takes this weight (K and N multiples of 8)."""
    return out_features % 8 == 0 and in_features % 8 == 0


@functools.cache
def rowwise_scaled_mm(device: torch.device) -> bool:
    """Whether ``_scaled_mm`` takes per-row / per-column float32 scales here (one tiny probe, cached)."""
    try:
        a = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn)
        sa = torch.full((16, 1), 2.0, device=device)
        sb = torch.full((1, 16), 3.0, device=device)
        y = torch._scaled_mm(a, a.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        return bool(torch.all(y.float() == 192.0))
    except (RuntimeError, NotImplementedError):
        return False
