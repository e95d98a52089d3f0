"""Mixed-input GEMMs in Triton: int8 / int4 weights read tile by tile and dequantized in registers.

Above the crossover (16 tokens int8, 32 int4) the torch path dequantizes the whole weight to bf16 per call:
it writes and re-reads 2 bytes per weight, 2.5x (int8) to 8x (int4) bf16's weight traffic. These kernels
read the stored weight once per M tile instead and multiply it with the activations on the tensor cores
(fp32 accumulation):

* :func:`int8_matmul`: ``weight_int8`` [N, K] int8 (row-major, as ``Int8WeightOnlyLinear`` stores it); the
  tile is converted to the activation dtype (exact) and the per-channel scale multiplies the fp32 result.
* :func:`int4_matmul`: the weight as ``Int4WeightOnlyLinear`` stores it on CUDA, tinygemm's packed layout
  (int32 [N/8, K/W, 32, H], ``W = 32 H`` = ``16 * inner_k_tiles``; see ``kernels._tinygemm_order``), with
  ``scales_and_zeros`` [K/group, N, 2] (``w = (q - 8) * scale + zero``). One K step is one super-tile: row
  ``r`` of it is ``4 H`` consecutive int32 words (index ``c * H + h``) whose nibble ``j`` is column
  ``32 h + 8 (j % 4) + 2 c + j // 4``. The unpacked tile is scaled in that order (a group, >= 32 columns and a
  multiple of 32, never splits the 32 columns of one ``h``, so one scale and zero per (row, h) suffices) and
  then put in column order by a permutation of index bits, so the activations load as plain rows.

Tile sizes come from a small fixed table per M bucket (:func:`config_for`), written for H100 / H200-class
GPUs; nothing is chosen by timing, so one process and the next run the same kernels. Under
``TRITON_INTERPRET=1`` (CPU) products are taken in float32 (the interpreter's bf16 ``tl.dot`` is wrong).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INT8_BLOCK_K = 64   # int8 needs K % 64 == 0 (no K masks in the inner loop); int4's K step is its super-tile


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and launch settings of one M bucket."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8


# (largest M, config): tensor-core tiles for sm80+ (smem per stage at BM=BN=128, BK=128 int4: 32 + 8 KB)
CONFIGS = (
    (32, GemmConfig(32, 64, 4, 4)),
    (64, GemmConfig(64, 64, 4, 4)),
    (128, GemmConfig(64, 128, 4, 4)),
    (1 << 62, GemmConfig(128, 128, 8, 3)),
)


def config_for(num_tokens: int) -> GemmConfig:
    """The fixed config of ``num_tokens``' bucket (<= 32, <= 64, <= 128, more)."""
    for top, config in CONFIGS:
        if num_tokens <= top:
            return config
    raise AssertionError("unreachable: the last bucket is unbounded")


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) in grouped order: GROUP_M row tiles walk the N tiles together (weight tiles reused in L2)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _store(c_ptr, acc, rows, cols, M, N, stride_cm):
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mask)


@triton.jit(do_not_specialize=["M"])
def int8_gemm_kernel(a_ptr, w_ptr, s_ptr, c_ptr, M, N, K, stride_am, stride_wn, stride_cm,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, DOT_FP32: tl.constexpr):
    # a: [M, K] float; w: [N, K] int8; s: [N] float32; c: [M, N]
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rows % M)[:, None].to(tl.int64) * stride_am + kk[None, :]   # out-of-range rows: reread
    w_ptrs = w_ptr + (cols % N)[:, None].to(tl.int64) * stride_wn + kk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs)
        w = tl.load(w_ptrs)
        if DOT_FP32:
            acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w.to(a.dtype)))
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    scale = tl.load(s_ptr + cols, mask=cols < N, other=0.0)
    _store(c_ptr, acc * scale[None, :], rows, cols, M, N, stride_cm)


@triton.jit
def _columns_in_order(w, BLOCK_N: tl.constexpr, H: tl.constexpr):
    """[BN, 4 (c), H (h), 8 (j)] in storage order -> [BN, 32 H] in column order ``32 h + 8 (j % 4) + 2 c + j // 4``
    (a permutation of index bits, so the compiler can do it in the layout rather than with a gather)."""
    w = tl.reshape(w, (BLOCK_N, 4, H, 2, 4))                    # j = 4 * (j // 4) + j % 4
    return tl.reshape(tl.permute(w, (0, 2, 4, 1, 3)), (BLOCK_N, 32 * H))   # (h, j % 4, c, j // 4)


@triton.jit(do_not_specialize=["M"])
def int4_gemm_kernel(a_ptr, p_ptr, sz_ptr, c_ptr, M, N, K, stride_am, stride_cm, GROUP_SIZE,
                     H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                     DOT_FP32: tl.constexpr):
    # a: [M, K] float; p: tinygemm int32 [N/8, K/(32 H), 32, H]; sz: [K/GROUP_SIZE, N, 2]; c: [M, N]
    WIDTH: tl.constexpr = 32 * H                  # columns per super-tile (one K step)
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n = cols % N                                   # N % 8 == 0; out-of-range columns reread real rows
    c4 = tl.arange(0, 4)[None, :, None]
    h = tl.arange(0, H)[None, None, :]
    # word (c, h) of row n in super-tile 0: n-tile stride K words, row stride 4 H words
    words0 = (n // 8).to(tl.int64)[:, None, None] * K + ((n % 8) * 4 * H)[:, None, None] + c4 * H + h
    j = tl.arange(0, 8)
    a_ptrs = a_ptr + (rows % M)[:, None].to(tl.int64) * stride_am + tl.arange(0, WIDTH)[None, :]
    sz_ptrs = sz_ptr + (n[:, None, None] + (32 * h // GROUP_SIZE) * N) * 2   # [BN, 1, H]
    shifts = 4 * j[None, None, None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, WIDTH):
        words = tl.load(p_ptr + words0 + k0)      # super-tile k0 / WIDTH starts k0 words further on
        group = (k0 // GROUP_SIZE) * N * 2
        scale = tl.load(sz_ptrs + group).to(tl.float32)
        offset = tl.load(sz_ptrs + group + 1).to(tl.float32) - 8.0 * scale
        q = ((words[:, :, :, None] >> shifts) & 15).to(tl.float32)      # [BN, 4 (c), H (h), 8 (j)]
        w = q * scale[:, :, :, None] + offset[:, :, :, None]
        a = tl.load(a_ptrs + k0)
        if DOT_FP32:
            acc += tl.dot(a.to(tl.float32), tl.trans(_columns_in_order(w, BLOCK_N, H)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(_columns_in_order(w.to(a.dtype), BLOCK_N, H)))
    _store(c_ptr, acc, rows, cols, M, N, stride_cm)


def _dot_fp32(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


def _grid(m: int, n: int, config: GemmConfig) -> tuple[int]:
    return (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)


def int8_matmul(x: torch.Tensor, weight_int8: torch.Tensor, scales: torch.Tensor,
                config: GemmConfig | None = None) -> torch.Tensor:
    """``x`` [M, K] (float) times ``(weight_int8 * scales[:, None]).T`` -> [M, N] in ``x.dtype``.

    Needs ``K % 64 == 0`` (:func:`int8_shape_problem`)."""
    m, k = x.shape
    n = weight_int8.shape[0]
    problem = int8_shape_problem(n, k)
    if problem is not None:
        raise ValueError(problem)
    x = x.contiguous()
    config = config or config_for(m)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    int8_gemm_kernel[_grid(m, n, config)](
        x, weight_int8, scales, out, m, n, k, x.stride(0), weight_int8.stride(0), out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=INT8_BLOCK_K, GROUP_M=config.group_m,
        DOT_FP32=_dot_fp32(x), num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                config: GemmConfig | None = None) -> torch.Tensor:
    """``x`` [M, K] times the int4 weight in tinygemm's layout ``packed`` [N/8, K/W, 32, W/64] (int32), with
    ``scales_and_zeros`` [K/group_size, N, 2] -> [M, N] in ``x.dtype``."""
    m, k = x.shape
    problem = int4_shape_problem(k, group_size, packed)
    if problem is not None:
        raise ValueError(problem)
    n, half = 8 * packed.shape[0], packed.shape[3]
    x = x.contiguous()
    config = config or config_for(m)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    int4_gemm_kernel[_grid(m, n, config)](
        x, packed.contiguous(), scales_and_zeros.contiguous(), out, m, n, k, x.stride(0), out.stride(0),
        group_size, H=half, BLOCK_M=config.block_m, BLOCK_N=config.block_n, GROUP_M=config.group_m,
        DOT_FP32=_dot_fp32(x), num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def int8_shape_problem(out_features: int, in_features: int) -> str | None:
    """Why :func:`int8_matmul` cannot take a weight [out, in] (``in % 64``), or ``None``."""
    if in_features % INT8_BLOCK_K:
        return f"in_features {in_features} is not a multiple of {INT8_BLOCK_K} (triton int8 GEMM)"
    return None


def int4_shape_problem(in_features: int, group_size: int, packed: torch.Tensor) -> str | None:
    """Why :func:`int4_matmul` cannot take this packed weight, or ``None``."""
    if packed.dim() != 4 or packed.dtype != torch.int32 or packed.shape[2] != 32:
        return f"packed weight {tuple(packed.shape)} {packed.dtype} is not tinygemm's CUDA layout"
    width = 32 * packed.shape[3]
    if packed.shape[3] not in (1, 2, 4) or in_features != packed.shape[1] * width:
        return f"packed weight {tuple(packed.shape)} does not hold {in_features} input features"
    if group_size % 32 or in_features % group_size:
        return f"group size {group_size}: needs a multiple of 32 that divides in_features {in_features}"
    return None
