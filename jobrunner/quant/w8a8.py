"""W8A8 on CPU: int8 per-channel weights, int8 per-token activations, one integer GEMM.

Weights are quantized as for ``int8`` (:func:`jobrunner.quant.primitives.quantize_int8_per_channel`: symmetric,
one bfloat16-exact scale per output channel). Each call quantizes every row of the input on its own, so a row's
result never depends on the other rows of the batch, and computes ``y[m, n] = s_m * w_n * sum_k q[m, k] * W[n,
k]`` with an exact int32 accumulation. On our GEMM (``vnni`` / ``amx``) and ``int_mm`` the rows are quantized
asymmetrically (:func:`~jobrunner.quant.primitives.quantize_rows_asym`: ``q = u - z``, u in 0..255, a scale and
a zero point per row: up to twice the resolution of symmetric codes on a lopsided row; perplexity in
docs/quantization.md); on ``onednn``, whose op takes one zero point per call, symmetrically (``s_m = max|x_m| /
127``, ``q = round(x / s_m)``).

Kernels (chosen per capability by :func:`jobrunner.quant.dispatch.w8a8_kernel_for`, never by a timing):

* ``onednn``: ``onednn::qlinear_pointwise`` on a weight prepacked once (``onednn::qlinear_prepack``), the
  kernel PyTorch's inductor uses for x86 int8 (AVX512-VNNI ``vpdpbusd``; AMX-INT8 tiles where present). The
  op takes one activation scale per call, so it runs with scale 1 and zero point 128 on the row codes
  (``u8 = q + 128``, exact) and applies the per-channel weight scales; its float32 output is then multiplied
  by the row scales. Used on capabilities with int8 dot-product hardware only: without VNNI oneDNN goes
  through ``vpmaddubsw``, whose int16 pair sums can saturate.
  The row quantization before it and the row scaling after it (float32 -> the activation dtype) are one C
  pass each (:mod:`jobrunner.quant.w8a8_native`, the same numbers as the torch ops, which run where no C
  compiler is found): with ~10 torch ops they cost more than the GEMM for the small layers at 64 tokens.
* ``vnni``: on CPUs with AVX-512 VNNI and bf16 activations (capability ``avx512_bf16``: AMD Zen 4 / Zen 5),
  the row quantization, an exact int32 ``vpdpbusd`` product and the scaling in one native call on a weight
  packed once (:mod:`jobrunner.quant.i8_gemm`, ``kernels/csrc/gemm/i8_gemm.c``): ~2x the packed bf16 GEMM at
  every row count on a Zen 4, so it takes every call (no weight-only crossover), with ``int_mm``'s bits. A
  layer shape it does not take (``out % 16``, ``in % 64``) runs ``onednn``; non-bf16 activations are rounded
  to bf16 first (then quantized to int8 anyway).
* ``amx``: the same on AMX-INT8 tiles (opt-in, ``JOBRUNNER_W8A8_AMX=1``; see :mod:`jobrunner.quant.i8_gemm`).
* ``int_mm``: ``torch._int_mm`` (int32 out) on the row codes, scaled afterwards. Exact on every CPU (slow
  without VNNI); the reference the tests compare the fast kernel with.

Measured candidates (``scripts/cpu_int8_gemm_bench.py``, a one-off at commit a75bf8c; docs/quantization.md): oneDNN
with u8 activations was the fastest int8 GEMM on a Zen 4 (avx512_vnni); with s8 activations it runs a reference
loop (~100x slower);
``quantized::linear_dynamic`` (fbgemm / x86) is as fast at few rows but quantizes the whole batch with one
scale (a row's result would depend on its neighbours); fbgemm's ``linear_with_input_q_dq_qweight_dq_output_fp32``
with the same row trick was slower than oneDNN at 64+ rows and not exact at 256.
"""

from __future__ import annotations

import torch

from jobrunner.quant.i8_gemm import vnni_linear, vnni_pack, vnni_packable
from jobrunner.quant.primitives import (
    ZERO_POINT,
    dequantize_int8,
    given_codes,
    int_mm_asym,
    quantize_int8_per_channel,
    quantize_rows_asym,
    quantize_rows_u8,
    signed_codes,
)
from jobrunner.quant.w8a8_native import w8a8_native

W8A8_KERNELS = ("onednn", "vnni", "amx", "int_mm")
PACKED_KERNELS = ("vnni", "amx")  # our GEMM (quant/i8_gemm.py): one packing, one entry point, the same bits


class W8A8Linear(torch.nn.Module):
    """Drop-in ``nn.Linear`` with int8 weights and dynamic per-token int8 activations (CPU)."""

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 kernel: str = "onednn", weight_only_tokens: int = 0, keep_plain: bool = True) -> None:
        super().__init__()
        if kernel not in W8A8_KERNELS:
            raise ValueError(f"unknown W8A8 kernel {kernel!r}: expected one of {'|'.join(W8A8_KERNELS)}")
        if weight_int8.device.type != "cpu":
            raise ValueError(f"W8A8Linear runs on CPU; the weight is on {weight_int8.device}")
        self.out_features, self.in_features = weight_int8.shape
        if kernel in PACKED_KERNELS and not vnni_packable(self.out_features, self.in_features):
            kernel = "onednn"
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scales", scales.float())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.kernel = kernel
        # up to this many rows: int8 weight-only (``_weight_int8pack_mm``, bf16 activations), faster for decode
        # at batch 1 (SmolLM2, Zen 4: 40.9 vs 32.3 tok/s); above, the int8 GEMM
        self.weight_only_tokens = weight_only_tokens
        self.register_buffer("scales_bf16", scales.to(torch.bfloat16))  # exact: scales are bf16 values
        self._packed = torch.ops.onednn.qlinear_prepack(weight_int8, None) if kernel == "onednn" else \
            vnni_pack(weight_int8, self.scales, kernel) if kernel in PACKED_KERNELS else None
        # one C pass each for the row quantization and the output scaling (None: torch ops)
        self._native = w8a8_native() if kernel == "onednn" else None
        self._zero_points = torch.zeros(self.out_features, dtype=torch.int64)
        self._weight_t = weight_int8.t().contiguous() if kernel == "int_mm" else None
        # int_mm's sum_k W per column (the asymmetric rows' zero points are taken off with it), once
        self._colsum = self._weight_t.sum(dim=0, dtype=torch.int32) if kernel == "int_mm" else None
        if self.kernel in PACKED_KERNELS and not keep_plain:
            # our GEMM reads only its packing: the plain int8 weight is dropped (1 byte per weight, not 2); the
            # codes come back from the tiles when asked (dequantized_weight). Kept where a tied embedding reads it.
            self.weight_int8 = None

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, kernel: str = "onednn", weight_only_tokens: int = 0,
                    keep_plain: bool = True) -> W8A8Linear:
        """Quantize ``linear`` (any float dtype, on CPU) into a new module (``keep_plain=False``: on our GEMM,
        hold only the packed weight)."""
        q, scales = given_codes(linear, "int8") or quantize_int8_per_channel(linear.weight)
        return cls(q, scales, linear.bias, kernel, weight_only_tokens, keep_plain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features]; the engine passes [num_tokens, in_features].
        x2 = x.reshape(-1, self.in_features)
        if self.kernel in PACKED_KERNELS:
            return self._vnni(x2).reshape(*x.shape[:-1], self.out_features)
        if x2.shape[0] <= self.weight_only_tokens:
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), self.weight_int8,
                                                   self.scales_bf16)
        else:
            y = self._onednn(x2) if self.kernel == "onednn" else self._int_mm(x2)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _onednn(self, x2: torch.Tensor) -> torch.Tensor:
        native = self._native if self._native is not None and self._native.takes(x2) else None
        u8, sx = native.quantize(x2) if native is not None else quantize_rows_u8(x2)
        y = torch.ops.onednn.qlinear_pointwise(u8, 1.0, ZERO_POINT, self._packed, self.scales, self._zero_points,
                                               None, 1.0, 0, torch.float32, "none", [], "")
        return native.rowscale(y, sx, x2.dtype) if native is not None else y.mul_(sx)

    def _vnni(self, x2: torch.Tensor) -> torch.Tensor:
        xb = x2.to(torch.bfloat16)
        if xb.stride(-1) != 1:
            xb = xb.contiguous()
        inside = self.bias is not None and self.bias.dtype == torch.bfloat16
        y = vnni_linear(xb, self._packed, self.out_features, self.bias if inside else None, self.kernel).to(x2.dtype)
        return y + self.bias.to(y.dtype) if self.bias is not None and not inside else y

    @property
    def vnni_packed(self) -> torch.Tensor | None:
        """The weight packed for our VNNI / AMX kernel (the layer loop calls it from C), None on another kernel."""
        return self._packed if self.kernel in PACKED_KERNELS else None

    def _int_mm(self, x2: torch.Tensor) -> torch.Tensor:
        # our GEMM's numbers (asymmetric rows): codes u - 128 fit int8, so sum (u - z) W = that product plus
        # (128 - z) sum_k W, exactly in int32; then oneDNN's order of the two scalings
        u, sx, zero = quantize_rows_asym(x2)
        acc = int_mm_asym(signed_codes(u), zero, self._weight_t, self._colsum)
        return acc.float().mul_(self.scales).mul_(sx)

    def codes(self) -> torch.Tensor:
        """The int8 weight [out, in]: the plain copy, or read back from our GEMM's tiles where it was dropped."""
        if self.weight_int8 is not None:
            return self.weight_int8
        n, k = self.out_features, self.in_features
        tiles = self._packed[: n * k].view(torch.int8).view(n // 16, k // 64, 16, 16, 4)  # [nb, kb, r, c, i]
        return tiles.permute(0, 3, 1, 2, 4).reshape(n, k)  # W[16 nb + c, 64 kb + 4 r + i]

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight this layer computes with, as a dense ``dtype`` tensor [out, in]."""
        return dequantize_int8(self.codes(), self.scales, dtype)

    def weight_bytes(self) -> int:
        """Bytes this layer holds for its weight: the int8 weight (read by the 1-token kernel, the report and a
        tied embedding), the kernel's own copy (:meth:`kernel_bytes`) and the scales (bias not included)."""
        plain = 0 if self.weight_int8 is None else self.weight_int8.numel()
        return plain + self.kernel_bytes() + self.scales.numel() * 4

    def kernel_bytes(self) -> int:
        """Bytes of the kernel's own copy of the weight (oneDNN's blocked layout; the VNNI tiles with their column
        sums and scales; ``_int_mm``'s transpose)."""
        copy = self._packed if self._packed is not None else self._weight_t
        return copy.numel() * copy.element_size()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}, "
                f"bias={self.bias is not None}")
