"""Int4 group-wise (asymmetric) weight-only linear layer on torch's tinygemm-style kernels.

Each run of ``group_size`` input features of one output row shares a scale and a zero:
``w = (q - 8) * scale + zero`` with q in 0..15. ``scales_and_zeros`` is [K / group_size, N, 2] bfloat16.
The kernels want bfloat16 activations, so other dtypes are cast in and out (float32 on CPU, float16 on CUDA).

The packed kernel wins at few tokens but its cost grows linearly with the token count; above
``small_batch_max_tokens`` (per machine, :mod:`jobrunner.quant.dispatch`) the weight is unpacked tile by tile
into a reused buffer in the machine's fast compute dtype and multiplied with one dense GEMM per tile. Both
packed layouts are read back exactly (CPU: ``int4_unpack``; CUDA: ``kernels.unpack_int4_cuda``), checked
against the codes at load time; a layer whose layout does not check out keeps the packed kernel for all sizes.
On CPUs with int8 dot-product hardware (VNNI / AMX) a third path takes every call above the packed kernel's
crossover (``max_kernel_tokens["int4_int8"]``; ``0`` turns it off): tiles expanded to int8 and an int8 GEMM
with per-token int8 activations (W4A8, :mod:`.int4_int8`), faster than bf16 at batch.
"""

from __future__ import annotations

import torch

from jobrunner.quant.dispatch import QuantDispatch, dispatch_for
from jobrunner.quant.int4_int8 import Int4AsInt8
from jobrunner.quant.int4_native import int4_unpack_fn
from jobrunner.quant.int4_unpack import find_cpu_layout
from jobrunner.quant.kernels import int4_mm, int4_shape_problem, pack_int4, unpack_int4_cuda
from jobrunner.quant.primitives import quantize_int4_groupwise
from jobrunner.quant.tiled import DequantBuffer, tile_rows_for, tiled_linear
from jobrunner.quant.triton_quant import int4_triton_fn, record_failure


class Int4WeightOnlyLinear(torch.nn.Module):
    """Drop-in replacement for ``nn.Linear`` holding an int4 group-wise weight packed for its device."""

    def __init__(self, q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, dispatch: QuantDispatch | None = None,
                 scratch: DequantBuffer | None = None, act_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = group_size
        problem = int4_shape_problem(self.out_features, self.in_features, group_size, q.device)
        if problem is not None:
            raise ValueError(f"int4 cannot take weight [{self.out_features}, {self.in_features}]: {problem}")
        self.register_buffer("weight_int4pack", pack_int4(q))
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.dispatch = dispatch or dispatch_for(q.device)
        self.scratch = scratch or DequantBuffer()
        self.small_batch_max_tokens = self.dispatch.kernel_tokens("int4")
        self._packed_on = q.device.type
        self.cpu_layout = None if q.is_cuda else find_cpu_layout(self.weight_int4pack, q)
        # CUDA: our reading of tinygemm's layout must reproduce the codes, else the kernel runs for all sizes.
        self.cuda_readable = q.is_cuda and torch.equal(unpack_int4_cuda(self.weight_int4pack), q.to(torch.uint8))
        # opt-in: above the crossover a Triton GEMM reads the packed weight (quant.triton_mixed), None = dequant
        self.triton_mm = int4_triton_fn(self.dispatch.uses_triton("int4")) if self.cuda_readable else None
        block = self.cpu_layout.block_n if self.cpu_layout is not None else 8
        self.tile_rows = tile_rows_for(self.out_features, self.in_features, self.dispatch.tile_weights, block)
        # CPU with int8 dot-product hardware: an int8 GEMM (weights expanded per tile) up to this many tokens
        self.int8 = Int4AsInt8.build(self) if self.cpu_layout is not None else None
        dtype = self.dispatch.compute_dtype or act_dtype
        if dtype is not None and self.dequant_available:  # sized at load time, not inside a CUDA graph capture
            self.scratch.reserve(self.tile_rows * self.in_features, dtype, q.device)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group_size: int, dispatch: QuantDispatch | None = None,
                    scratch: DequantBuffer | None = None) -> Int4WeightOnlyLinear:
        """Quantize ``linear`` into a new module on its device (``ValueError`` if the shape can't fit)."""
        device = linear.weight.device
        problem = int4_shape_problem(linear.out_features, linear.in_features, group_size, device)
        if problem is not None:
            raise ValueError(f"int4 cannot take {linear}: {problem}")
        # CPU: codes at a byte each (packed by row blocks); tinygemm's CUDA packing reads int32 codes
        codes = torch.int32 if device.type == "cuda" else torch.uint8
        q, scales_and_zeros = quantize_int4_groupwise(linear.weight, group_size, codes)
        return cls(q, scales_and_zeros, group_size, linear.bias, dispatch, scratch, linear.weight.dtype)

    @property
    def dequant_available(self) -> bool:
        """Whether the packed weight can be read back (needed by the large-batch path)."""
        return self.cpu_layout is not None or self.cuda_readable

    def path(self, num_tokens: int) -> str:
        """Which path a call with ``num_tokens`` rows takes: ``packed`` | ``int8`` | ``triton`` | ``dequant``."""
        if num_tokens <= self.small_batch_max_tokens or not self.dequant_available:
            return "packed"
        if self.int8 is not None and num_tokens <= self.int8.max_tokens:
            return "int8"
        return "dequant" if self.triton_mm is None else "triton"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features]; the engine passes [num_tokens, in_features].
        if x.device.type != self._packed_on:
            raise RuntimeError(
                f"int4 weight was packed for {self._packed_on}; quantize after moving the model")
        x2 = x.reshape(-1, self.in_features)
        path = self.path(x2.shape[0])
        y = self._triton_forward(x2) if path == "triton" else None
        if path == "packed":
            y = int4_mm(x2.to(torch.bfloat16).contiguous(), self.weight_int4pack, self.group_size,
                        self.scales_and_zeros)
        elif path == "int8":
            y = self.int8.forward(x2)
        elif y is None:
            dtype = self.dispatch.compute_dtype_for(x2.dtype)
            y = tiled_linear(x2.to(dtype), self.out_features, self._fill, self.scratch, self.tile_rows)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _triton_forward(self, x2: torch.Tensor) -> torch.Tensor | None:
        """The Triton GEMM's result, or None after a failure (this layer then dequantizes for good)."""
        try:
            return self.triton_mm(x2, self.weight_int4pack, self.scales_and_zeros, self.group_size)
        except Exception as exc:  # noqa: BLE001 - never a crash: the tested torch path takes over
            record_failure("int4", exc)
            self.triton_mm = None
            return None

    def _fill(self, n0: int, n1: int, out: torch.Tensor) -> torch.Tensor:
        """Write rows ``[n0, n1)`` of the dequantized weight into ``out``'s memory; return them as [rows, K]."""
        k, rows = self.in_features, n1 - n0
        groups = k // self.group_size
        scale, zero = self._scales_and_offsets(n0, n1)
        if self.cpu_layout is not None:  # the CPU layout stores K-major blocks: build W^T [K, rows]
            wt = out.reshape(-1)[: k * rows].view(k, rows)
            done = self._fill_native(n0, n1, wt, scale, zero)
            if done < rows:  # torch ops for the rest (all of it without the native unpack)
                rest = wt[:, done:]
                self.cpu_layout.unpack_rows_t(self.weight_int4pack, n0 + done, n1, rest)
                rest.unflatten(0, (groups, self.group_size)).mul_(scale[:, None, done:].to(wt.dtype)).add_(
                    zero[:, None, done:].to(wt.dtype))
            return wt.t()
        out.copy_(unpack_int4_cuda(self.weight_int4pack, n0 // 8, n1 // 8))
        grouped = out.unflatten(1, (groups, self.group_size))
        grouped.mul_(scale.t()[:, :, None].to(out.dtype)).add_(zero.t()[:, :, None].to(out.dtype))
        return out

    def _fill_native(self, n0: int, n1: int, wt: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> int:
        """Whole blocks of rows ``[n0, n1)`` through the one-pass C unpack (float32 / bfloat16); columns done."""
        unpack = int4_unpack_fn(wt.dtype)
        layout = self.cpu_layout
        full = min(n1, layout.num_full_rows) - n0
        if unpack is None or full <= 0:
            return 0
        half = layout.block_n // 2
        b0, nb = n0 // layout.block_n, full // layout.block_n
        blocks = self.weight_int4pack.reshape(-1)[b0 * self.in_features * half:(b0 + nb) * self.in_features * half]
        unpack(blocks.view(nb, self.in_features, half), scale, zero, wt, layout.block_n, layout.is_split,
               self.group_size)
        return full

    def _scales_and_offsets(self, n0: int, n1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous float32 ``scale`` and ``zero - 8 * scale`` [groups, n1 - n0], so ``w = q * scale + offset``.

        Read from the bfloat16 pairs as bits (a bf16 is the top half of a float32): slicing every other
        element out of [groups, N, 2] instead gives strided operands that make the multiply below ~10x slower.
        """
        pairs = self.scales_and_zeros[:, n0:n1].contiguous().view(torch.int32).squeeze(-1)  # [groups, rows]
        scale = (pairs << 16).view(torch.float32)  # element 0 of each pair is the low half (little endian)
        zero = (pairs & -65536).view(torch.float32)
        return scale, zero.sub_(scale, alpha=8)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight this layer computes with, as a dense ``dtype`` tensor [out, in]."""
        if not self.dequant_available:  # recover W^T through the kernel with an identity (slow, exact)
            eye = torch.eye(self.in_features, device=self.weight_int4pack.device, dtype=torch.bfloat16)
            return int4_mm(eye, self.weight_int4pack, self.group_size, self.scales_and_zeros).t().to(dtype)
        out = torch.empty(self.out_features, self.in_features, dtype=dtype, device=self.weight_int4pack.device)
        return self._fill(0, self.out_features, out).contiguous()

    def weight_bytes(self) -> int:
        """Bytes of the packed weight and its scales/zeros (bias not included)."""
        return sum(t.numel() * t.element_size() for t in (self.weight_int4pack, self.scales_and_zeros))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")
