"""GPTQ / AWQ packed int4 and compressed-tensors FP8 tensors -> our layouts, exactly, with integer ops only.

Our int4 (:mod:`jobrunner.quant.int4`): codes ``q`` [N, K] in 0..15 and ``scales_and_zeros`` [K / g, N, 2] with
``w = (q - 8) * scale + zero``. Both formats store ``w = (q - z) * s`` with an integer zero point ``z`` in 0..15
and a float16 scale ``s`` per group and output channel, so the codes are kept as they are and
``scale = s``, ``zero = (8 - z) * s``: in float32 both are exact (``s`` has 11 significant bits, ``8 - z`` at
most 5), and so is every dequantized weight ``(q - 8) * s + (8 - z) * s = (q - z) * s``.

Packing, as the tools write it (int32 words, nibble ``i`` at bits ``4i .. 4i + 3``):

* GPTQ ``qweight`` [K / 8, N]: word ``(r, n)`` holds rows ``k = 8r + i``. ``qzeros`` [G, N / 8]: word ``(g, c)``
  holds columns ``n = 8c + i``. The v1 format (``checkpoint_format: gptq``) stores ``z - 1``: its writer
  subtracts ``0x11111111`` from each whole word (borrows included), so it is read back by adding it to the
  whole word (mod 2^32), not nibble by nibble (which gets ``z = 0`` wrong). ``g_idx`` must be ``k // g``.
* AWQ (GEMM) ``qweight`` [K, N / 8] and ``qzeros`` [G, N / 8]: word ``(r, c)`` holds columns ``8c + ORDER[i]``
  in nibble ``i``, ``ORDER = 0, 2, 4, 6, 1, 3, 5, 7``; zeros stored as they are.
"""

from __future__ import annotations

import torch

SHIFTS = tuple(range(0, 32, 4))
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]
V1_ZERO_OFFSET = 0x11111111  # GPTQ v1: one subtracted from each zero, as a whole-word subtraction


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., W] -> their 8 nibbles [..., W, 8] (uint8, nibble i = bits 4i..4i+3)."""
    shifts = torch.tensor(SHIFTS, dtype=torch.int64, device=words.device)
    return ((words.to(torch.int64) & 0xFFFFFFFF).unsqueeze(-1) >> shifts & 15).to(torch.uint8)


def gptq_codes(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ ``qweight`` int32 [K / 8, N] -> codes [N, K] uint8 (0..15)."""
    rows, n = qweight.shape
    return _nibbles(qweight).permute(0, 2, 1).reshape(rows * 8, n).t().contiguous()


def gptq_zeros(qzeros: torch.Tensor, zero_format: str) -> torch.Tensor:
    """GPTQ ``qzeros`` int32 [G, N / 8] -> zero points [G, N] int32 (0..15); ``zero_format`` ``v1`` | ``v2``."""
    words = qzeros.to(torch.int64) & 0xFFFFFFFF
    if zero_format == "v1":
        words = (words + V1_ZERO_OFFSET) & 0xFFFFFFFF
    return _nibbles(words).reshape(qzeros.shape[0], -1).to(torch.int32)


def awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM int32 [R, N / 8] -> [R, N] uint8, columns in their true order."""
    nib = _nibbles(words)  # [R, N/8, 8]: nibble i is column AWQ_ORDER[i] of its group of 8
    out = torch.empty_like(nib)
    out[..., list(AWQ_ORDER)] = nib
    return out.reshape(words.shape[0], -1)


def check_g_idx(g_idx: torch.Tensor | None, group_size: int) -> None:
    """``ValueError`` unless ``g_idx`` is the plain ``k // group_size`` (``desc_act: false``)."""
    if g_idx is None:
        return
    plain = torch.arange(g_idx.numel(), device=g_idx.device) // group_size
    if not torch.equal(g_idx.to(torch.int64).reshape(-1), plain):
        raise ValueError("g_idx is not k // group_size (a reordered, desc_act checkpoint): not supported")


def int4_scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Per-group ``scales`` [G, N] (float16) and integer ``zeros`` [G, N] -> ours [G, N, 2] float32, exact."""
    s = scales.to(torch.float32)
    return torch.stack([s, (8 - zeros.to(torch.float32)) * s], dim=-1)


def regroup(scales_and_zeros: torch.Tensor, group_size: int, kernel_group: int) -> torch.Tensor:
    """Repeat each group's pair so groups of ``group_size`` become groups of ``kernel_group`` (a divisor): a
    per-channel checkpoint (one group of K) runs on the kernel's group sizes with the same numbers."""
    return scales_and_zeros.repeat_interleave(group_size // kernel_group, dim=0)


def layer_group(k: int, groups: int, group_size: int | None) -> int:
    """The group one layer's ``k`` input rows run at, with ``groups`` rows of scales: ``k`` per channel
    (``group_size`` None); ``k / groups`` where that divides ``group_size`` (the checkpoint's own group, or a
    tensor-parallel shard's regrouped one: :mod:`jobrunner.quant.prequantized.shard`); else ``group_size``."""
    if group_size is None:
        return k
    per = k // groups if groups and k % groups == 0 else 0
    return per if per and group_size % per == 0 else group_size


def gptq_to_int4(tensors: dict[str, torch.Tensor], group_size: int | None,
                 zero_format: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One GPTQ linear (``qweight``, ``qzeros``, ``scales``, optional ``g_idx``) -> ``(codes [N, K] uint8,
    scales_and_zeros [G, N, 2] float32, group size)``; per channel: one group of K."""
    codes = gptq_codes(tensors["qweight"])
    group = layer_group(codes.shape[1], tensors["scales"].shape[0], group_size)
    check_g_idx(tensors.get("g_idx"), group)
    zeros = gptq_zeros(tensors["qzeros"], zero_format)[:, : codes.shape[0]]
    return codes, int4_scales_and_zeros(tensors["scales"], zeros), group


def awq_to_int4(tensors: dict[str, torch.Tensor], group_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One AWQ GEMM linear (``qweight``, ``qzeros``, ``scales``) -> ``(codes [N, K] uint8, scales_and_zeros
    [G, N, 2] float32, group size)``."""
    codes = awq_unpack(tensors["qweight"]).t().contiguous()
    zeros = awq_unpack(tensors["qzeros"]).to(torch.int32)
    return codes, int4_scales_and_zeros(tensors["scales"], zeros), layer_group(codes.shape[1],
                                                                                tensors["scales"].shape[0], group_size)


def fp8_weight_and_scales(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One compressed-tensors FP8 linear (``weight`` e4m3 [N, K], ``weight_scale`` [N, 1] / [1] / []) ->
    ``(weight e4m3 [N, K], scales [N] float32)``; a per-tensor scale is repeated per row (exact)."""
    weight, scale = tensors["weight"], tensors["weight_scale"]
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight is {weight.dtype}, expected float8_e4m3fn")
    if "input_scale" in tensors:
        raise ValueError("has a static input_scale (only dynamic per-token activations are supported)")
    scale = scale.to(torch.float32).reshape(-1)
    if scale.numel() not in (1, weight.shape[0]):
        raise ValueError(f"weight_scale has {scale.numel()} values for {weight.shape[0]} rows")
    return weight, scale.expand(weight.shape[0]).contiguous()
