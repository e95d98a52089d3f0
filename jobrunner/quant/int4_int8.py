"""The int4 layer's batch path on CPUs with int8 dot-product hardware: int4 weights expanded to int8 tile by
tile, activations quantized per token, one integer GEMM per tile (``torch._int_mm``).

Why: on a Zen 4 (avx512_bf16 + VNNI, no AMX) the int8 GEMM runs about twice as fast as the bf16 GEMM at 64
rows (SmolLM2 gate_up 3072 x 576: 0.41 ms vs 0.78 ms, 2 threads), while int4's packed kernel takes 2.4 ms
and dequantizing tiles to bf16 costs the bf16 GEMM plus the unpack. The weight stays int4 in memory: only one
tile at a time exists as int8, in the model's shared scratch buffer.

How the group scales are handled: each output row ``n`` gets one int8 scale ``S_n = max_k |w[n, k]| / 127``
(``w`` the dequantized int4 weight, computed once at load). A tile is expanded by the native loop
(:func:`jobrunner.quant.int4_native.int4_to_int8_fn`) as ``w8[n, k] = rint(((q - 8) * scale_g + zero_g) / S_n)``;
an int4 group has at most 16 distinct values and the int8 grid is 8-16x finer than the group's step, so this
re-rounding adds little to the int4 error. Activations: per token (row) asymmetric codes
(:func:`~jobrunner.quant.primitives.quantize_rows_asym`: ``x ~ s_m (u - z_m)``, u in 0..255), so a row's result
never depends on the other rows of the batch. Then ``y[m, n] = (sum_k (u[m, k] - z_m) w8[n, k] * S_n) * s_m``,
with an exact int32 sum. Asymmetric since 2026-12-06: W4A8's perplexity cost on SmolLM2-135M went +3.18% ->
+1.70% against float32 (30 held-out texts; symmetric rows ``s_m = max|x_m| / 127`` before, docs/quantization.md);
most of int4's W4A8 error was the activations' (weight-only int4 costs ~0.2%).

This path is used only where the dispatch says the CPU has int8 dot-product hardware (VNNI / AMX-INT8; see
:data:`jobrunner.quant.dispatch.INT8_DOT_CAPABILITIES`) and only for token counts in
``(max_kernel_tokens["int4"], max_kernel_tokens["int4_int8"]]``: a pure function of the capability. By default
that is every count above 16 (SmolLM2-135M at batch 64: 1.1-1.4x bf16; perplexity +3.47% against float32 on
10,065 held-out tokens, +0.19% weight-only; docs/quantization.md). The expansion is one C call per tile
(:data:`INT8_TILE_WEIGHTS`), and the row quantization and output scaling are C loops too
(:mod:`jobrunner.quant.w8a8_native`).

Where W8A8 runs on our own GEMM (:mod:`jobrunner.quant.i8_gemm`: ``vnni`` on avx512_bf16, opt-in ``amx``), a bf16
call takes one native call instead (``jr_i4_linear``, kernels/csrc/gemm/i8_gemm.c), which quantizes the rows
itself and takes the per-column offsets and scales computed once here. On the VNNI build (and the split int4
layout of AVX-512 CPUs) each thread expands its own column blocks, four at a time, straight into the GEMM's
operand layout in a buffer of its own and multiplies them at once: no N x K intermediate. Elsewhere (the AMX
tile build, other layouts) the whole layer is expanded to int8 W^T by the same C loop, packed into the GEMM's
tiles, then multiplied. On a 2-core Zen 4 at 48 rows the first takes SmolLM2-135M's four layer shapes in
724-768 µs against 881 (``/work/bench/i4.py`` in the session's note); 48 ShareGPT prompts x 64 tokens, EOS
ignored, held ISA: int4 0.98x bf16 before, 1.25x after (three rounds; docs/quantization.md).

The numbers are this module's (the same codes, scales, exact int32 sums and ``(acc * S_n) * s_m`` order: tested
bit for bit, both ways); the second way's scratch is the layer's int8 W^T and its packed tiles, shared by the
model's int4 layers (``2 N K + 8 N`` bytes for the largest, taken at the first call, not at load: the load's
memory peak stays that of the weights; the first way takes none), and the layer loop (models/layer_loop.py)
calls the same function.
"""

from __future__ import annotations

import ctypes
from typing import Protocol

import torch

from jobrunner.kernels import Int4Linear
from jobrunner.quant.dispatch import QuantDispatch
from jobrunner.quant.i8_gemm import library as i8_library
from jobrunner.quant.int4_native import int4_to_int8_fn
from jobrunner.quant.int4_unpack import CpuInt4Layout
from jobrunner.quant.primitives import (
    expand_int8_reference,
    int8_row_scales,
    int_mm_asym,
    quantize_rows_asym,
    signed_codes,
)
from jobrunner.quant.tiled import DequantBuffer, tile_rows_for
from jobrunner.quant.w8a8_native import w8a8_native

# Weights expanded per tile (int8 bytes). Each tile costs one C call, one int8 GEMM and one output pass, so
# fewer, larger tiles win here, unlike the float tiles (CPU_TILE_WEIGHTS, 2^18): SmolLM2 gate_up (1.77 M
# weights) at 64 rows, 2 threads, Zen 4: 1230 / 698 / 595 / 600 µs with tiles of 2^18 / 2^20 / 2^21 / 2^22
# weights (bf16 GEMM 707). The GEMM then reads a 2 MB tile just written, from L2 / L3.
INT8_TILE_WEIGHTS = 1 << 21


class PackedInt4(Protocol):
    """What this path reads of its CPU :class:`~jobrunner.quant.int4.Int4WeightOnlyLinear` (named here, not
    imported: the layer builds this path, so an import back would be a circle)."""

    out_features: int
    in_features: int
    group_size: int
    weight_int4pack: torch.Tensor  # uint8, the CPU kernel's block layout
    scales_and_zeros: torch.Tensor  # bf16 [groups, N, 2]
    cpu_layout: CpuInt4Layout
    dispatch: QuantDispatch
    scratch: DequantBuffer
    small_batch_max_tokens: int


class Int4AsInt8:
    """The int8-GEMM path of one CPU :class:`~jobrunner.quant.int4.Int4WeightOnlyLinear` (see the module doc)."""

    def __init__(self, layer: PackedInt4, max_tokens: int, tile_weights: int) -> None:
        self.layer = layer
        self.max_tokens = max_tokens
        self.row_scale = int8_row_scales(layer.scales_and_zeros)  # [N] float32: N * 4 bytes per layer
        self.inv_row_scale = (1.0 / self.row_scale).contiguous()
        layout = layer.cpu_layout
        self.tile_rows = tile_rows_for(layer.out_features, layer.in_features, tile_weights, layout.block_n)
        self.expand = int4_to_int8_fn()
        self.native = w8a8_native()  # the row quantization and output scaling in C (None: torch ops)
        layer.scratch.reserve(self.tile_rows * layer.in_features, torch.int8, layer.weight_int4pack.device)
        # our W8A8 GEMM for the whole call (module doc), or None: torch._int_mm per tile
        self.kernel = self._packed_kernel()
        self.struct: Int4Linear | None = None
        self.trailer: torch.Tensor | None = None  # the column offsets and scales, made at the first call
        self._colsum: torch.Tensor | None = None  # sum_k W8 per column (the per-tile path's asymmetric rows)
        if self.kernel is not None:
            self.linear_fn = i8_library(self.kernel).jr_i4_linear

    def _trailer(self) -> torch.Tensor:
        """[2 N] int32: the column offsets ``128 * sum_k W8[n, k]`` (from the expansion, tile by tile in the tile
        scratch), then the row scales' bits; made at the first call, so a load's memory peak does not grow."""
        layer = self.layer
        n, k = layer.out_features, layer.in_features
        offsets = torch.empty(n, dtype=torch.int32)
        scratch = layer.scratch.get(self.tile_rows * k, torch.int8, layer.weight_int4pack.device)
        for n0 in range(0, n, self.tile_rows):
            n1 = min(n, n0 + self.tile_rows)
            wt = self.fill(n0, n1, scratch[: (n1 - n0) * k].view(k, n1 - n0))
            offsets[n0:n1] = wt.sum(dim=0, dtype=torch.int32)
        return torch.cat([offsets.mul_(128), self.row_scale.view(torch.int32)])

    @property
    def expands_per_block(self) -> bool:
        """Whether ``jr_i4_linear`` expands column blocks per thread (the VNNI build, the split layout with blocks
        of a multiple of 32 columns; its condition in i8_gemm.c) rather than the whole layer into the scratch."""
        layer, layout = self.layer, self.layer.cpu_layout
        return self.kernel == "vnni" and layout.is_split and layout.block_n % 32 == 0 and layout.block_n <= 64 \
            and layer.group_size % 4 == 0 and layer.in_features % layer.group_size == 0

    def _packed_kernel(self) -> str | None:
        """``vnni`` / ``amx`` where W8A8 runs on our GEMM and takes this layer whole, else None."""
        layer, layout = self.layer, self.layer.cpu_layout
        kernel = layer.dispatch.w8a8_kernel
        if kernel not in ("vnni", "amx") or isinstance(i8_library(kernel), str):
            return None
        n, k = layer.out_features, layer.in_features
        if layout.num_full_rows != n or n % 16 or k % 64 or k >= 66000 or self.expand is None:
            return None
        return kernel

    def bind(self) -> Int4Linear:
        """The ``JrInt4Linear`` of this layer (one struct, its address stable for the layer loop), every pointer
        set from the tensors as they are now (the shared scratch may have grown since the last call: a larger
        layer reserved after this one was built)."""
        layer = self.layer
        n, k = layer.out_features, layer.in_features
        trailer = self.trailer_tensor()
        wt = tiles = None  # the per-thread expansion (module doc) needs no scratch
        if not self.expands_per_block:
            wt = layer.scratch.get(k * n, torch.int8, layer.weight_int4pack.device)
            tiles = layer.scratch.get(k * n + 8 * n, torch.uint8, layer.weight_int4pack.device)
        if self.struct is None:
            from jobrunner.quant.int4_native import _library

            layout = layer.cpu_layout
            self.struct = Int4Linear(expand=ctypes.cast(_library().jr_int4_to_int8_t, ctypes.c_void_p).value,
                                     block_n=layout.block_n, split=int(layout.is_split), group=layer.group_size)
        s = self.struct
        s.packed, s.pairs = layer.weight_int4pack.data_ptr(), layer.scales_and_zeros.data_ptr()
        s.inv, s.trailer = self.inv_row_scale.data_ptr(), trailer.data_ptr()
        s.wt, s.tiles = (None, None) if wt is None else (wt.data_ptr(), tiles.data_ptr())
        s.pair_stride = layer.scales_and_zeros.stride(0) // 2
        return s

    def packed_forward(self, x2: torch.Tensor) -> torch.Tensor:
        """The whole call through ``jr_i4_linear`` (bf16 rows, unit column stride; the module doc)."""
        layer = self.layer
        n, k = layer.out_features, layer.in_features
        xb = x2 if x2.stride(-1) == 1 else x2.contiguous()
        out = torch.empty(x2.shape[0], n, dtype=torch.bfloat16)
        rc = self.linear_fn(xb.data_ptr(), xb.stride(0), ctypes.byref(self.bind()), None, out.data_ptr(), n,
                            x2.shape[0], n, k, torch.get_num_threads())
        if rc:
            raise RuntimeError(f"int4 W4A8 kernel refused a call of {x2.shape[0]} x {k} -> {n} (code {rc})")
        return out

    @classmethod
    def build(cls, layer: PackedInt4) -> Int4AsInt8 | None:
        """The path for ``layer`` when its dispatch asks for it and the native expansion exists, else None."""
        max_tokens = layer.dispatch.kernel_tokens("int4_int8")
        if max_tokens <= layer.small_batch_max_tokens or int4_to_int8_fn() is None:
            return None
        return cls(layer, max_tokens, INT8_TILE_WEIGHTS)

    def forward(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 [M, K] @ W.T`` in ``x2``'s dtype (float32 for other dtypes than float32 / bfloat16)."""
        if self.kernel is not None and x2.dtype == torch.bfloat16:
            return self.packed_forward(x2)
        layer = self.layer
        k, n = layer.in_features, layer.out_features
        native = self.native if self.native is not None and self.native.takes(x2) else None
        u, x_scale, zero = quantize_rows_asym(x2)  # asymmetric rows: our GEMM's numbers
        xq, colsum = signed_codes(u), self.column_sums()
        y = torch.empty(x2.shape[0], n, dtype=x2.dtype if x2.dtype in (torch.float32, torch.bfloat16)
                        else torch.float32)
        scratch = layer.scratch.get(self.tile_rows * k, torch.int8, x2.device)
        for n0 in range(0, n, self.tile_rows):
            n1 = min(n, n0 + self.tile_rows)
            wt = self.fill(n0, n1, scratch[: (n1 - n0) * k].view(k, n1 - n0))
            acc = int_mm_asym(xq, zero, wt, colsum[n0:n1])
            if native is not None:
                native.scale_int32(acc, x_scale, self.row_scale[n0:n1], y[:, n0:n1])
            else:
                y[:, n0:n1] = acc.mul(self.row_scale[n0:n1]).mul_(x_scale)
        return y

    def trailer_tensor(self) -> torch.Tensor:
        """The trailer (:meth:`_trailer`), made at the first call that needs it."""
        if self.trailer is None:
            self.trailer = self._trailer()
        return self.trailer

    def column_sums(self) -> torch.Tensor:
        """[N] int32: ``sum_k W8[n, k]`` (the trailer's offsets are 128 times these; made once)."""
        if self._colsum is None:
            self._colsum = self.trailer_tensor()[: self.layer.out_features] >> 7
        return self._colsum

    def fill(self, n0: int, n1: int, out: torch.Tensor) -> torch.Tensor:
        """Write the int8 codes of rows ``[n0, n1)`` transposed into ``out`` [K, n1 - n0]; return it."""
        layer, layout = self.layer, self.layer.cpu_layout
        k, half = layer.in_features, layout.block_n // 2
        full = max(0, min(n1, layout.num_full_rows) - n0) // layout.block_n * layout.block_n
        if full:
            b0, nb = n0 // layout.block_n, full // layout.block_n
            blocks = layer.weight_int4pack.reshape(-1)[b0 * k * half:(b0 + nb) * k * half].view(nb, k, half)
            self.expand(blocks, layer.scales_and_zeros[:, n0:n0 + full], self.inv_row_scale[n0:n0 + full], out,
                        layout.block_n, layout.is_split, layer.group_size)
        if n0 + full < n1:  # a partial last block (stored interleaved): gathered with torch ops
            rows = torch.arange(n0 + full, n1, device=out.device)
            codes = layout.gather_rows(layer.weight_int4pack, rows)
            out[:, full:].copy_(expand_int8_reference(codes, layer.scales_and_zeros[:, n0 + full:n1],
                                                      layer.group_size, self.row_scale[n0 + full:n1]).t())
        return out
