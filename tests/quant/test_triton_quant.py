"""The opt-in Triton quant kernels (fused fp8 activation quantization, int8/int4 mixed-input GEMMs).

The kernels run under Triton's CPU interpreter in a child pytest (``TRITON_INTERPRET=1`` must be set before
triton is imported; see ``test_kernels_under_the_triton_interpreter``), against torch / float64 references.
The parent checks the dispatch and its fallbacks without CUDA, and compiles the kernels to PTX for sm_90 (no
GPU needed) to catch what only the compiler rejects. Speed is measured by scripts/gpu_quant_bench.py on a GPU.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from jobrunner.models.factory import describe_dispatch
from jobrunner.quant import Int8WeightOnlyLinear, dispatch_for
from jobrunner.quant.dispatch import CROSSOVER_ENV
from jobrunner.quant.kernels import cuda_inner_k_tiles, pack_int4_cuda_reference
from jobrunner.quant.primitives import (
    fp8_w8a8_reference,
    quantize_fp8_per_channel,
    quantize_fp8_per_token,
    quantize_int4_groupwise,
    quantize_int8_per_channel,
)
from jobrunner.quant.triton_quant import TRITON_QUANT_ENV, requested_schemes
from tests.components import require_import
from tests.triton_child import in_child, interpreted_fixture, run_in_interpreter_child

CHILD_FLAG = "JOBRUNNER_TRITON_QUANT_CHILD"
IN_CHILD = in_child(CHILD_FLAG)
interpreted = interpreted_fixture(CHILD_FLAG)


@pytest.mark.skipif(IN_CHILD, reason="this is the parent test")
def test_kernels_under_the_triton_interpreter():
    run_in_interpreter_child(__file__, CHILD_FLAG, "interp and not under_the",
                             "a [test] dependency on Linux: its CPU interpreter runs our quant kernels",
                             drop_env=(TRITON_QUANT_ENV,))


def _f64_int4(q: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dequantized int4 weight in float64 from codes and the bf16 scales/zeros the layer stores."""
    n, k = q.shape
    s = sz.to(torch.bfloat16).double()
    w = (q.double().view(n, k // group_size, group_size) - 8) * s[..., 0].t()[..., None] + s[..., 1].t()[..., None]
    return w.view(n, k)


def _max_rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


def test_interp_fp8_quantization_is_torch_bit_for_bit(interpreted, monkeypatch):
    from jobrunner.quant import triton_fp8

    monkeypatch.setattr(triton_fp8, "MAX_BLOCK_K", 128)   # three column blocks per row: the two-pass loop
    torch.manual_seed(0)
    x = torch.randn(5, 300) * torch.logspace(-3, 3, 300)
    x[2] = 0                                               # all-zero row: scale 1e-12, zeros
    x[3] = torch.randn(300) * 1e-3
    x[3, 7] = 1.0                                          # e4m3 subnormals (|x / scale| < 2^-6)
    x[4, :4] = torch.tensor([125.1, 127.6, -31.31, 447.0]) * x[4].abs().max() / 448  # carries into the exponent
    for dtype in (torch.float32, torch.bfloat16):
        want_q, want_s = quantize_fp8_per_token(x.to(dtype))
        for out_dtype in (torch.float8_e4m3fn, torch.float32):
            q, s = triton_fp8.quantize_rows_fp8(x.to(dtype), out_dtype=out_dtype)
            assert q.shape == (16, 300) and q.dtype == out_dtype and s.shape == (16, 1)
            assert torch.equal(q[:5].float(), want_q.float()) and torch.equal(s[:5], want_s)
            assert torch.all(q[5:].float() == 0) and torch.all(s[5:] == 1)   # padding rows for _scaled_mm


def test_interp_fp8_fused_linear_matches_the_w8a8_reference(interpreted):
    from jobrunner.quant.triton_fp8 import fp8_linear_fused

    torch.manual_seed(1)
    wq, scales = quantize_fp8_per_channel(torch.randn(48, 96))
    x = torch.randn(7, 96).bfloat16()
    y = fp8_linear_fused(x, wq, scales)                    # torch._scaled_mm runs on CPU too
    assert y.shape == (7, 48) and y.dtype == torch.bfloat16
    ref = fp8_w8a8_reference(x, wq, scales)
    assert _max_rel(y, ref.double()) < 4e-3               # bf16 output rounding only


def test_interp_int8_gemm_against_float64(interpreted):
    from jobrunner.quant.triton_mixed import GemmConfig, int8_matmul

    torch.manual_seed(2)
    small = GemmConfig(16, 16, 4, 1)                       # M, N not multiples of the block
    for m, n, k, config in ((19, 40, 128, small), (5, 24, 64, small), (3, 72, 192, None)):
        q, s = quantize_int8_per_channel(torch.randn(n, k))
        x = torch.randn(m, k)
        ref = x.double() @ (q.double() * s.double()[:, None]).t()
        assert _max_rel(int8_matmul(x, q, s, config), ref) < 1e-6
        y16 = int8_matmul(x.bfloat16(), q, s, config)
        assert y16.dtype == torch.bfloat16
        assert _max_rel(y16, x.bfloat16().double() @ (q.double() * s.double()[:, None]).t()) < 1e-2


@pytest.mark.parametrize("m,n,k,group_size", [(5, 24, 96, 32), (19, 16, 128, 64), (3, 8, 256, 256),
                                              (17, 32, 64, 32)])
def test_interp_int4_gemm_reads_the_tinygemm_layout(interpreted, m, n, k, group_size):
    from jobrunner.quant.triton_mixed import GemmConfig, int4_matmul

    torch.manual_seed(m)
    q, sz = quantize_int4_groupwise(torch.randn(n, k), group_size)
    packed = pack_int4_cuda_reference(q, cuda_inner_k_tiles(k))   # inner_k_tiles 2 / 8 / 8 / 4
    x = torch.randn(m, k)
    y = int4_matmul(x, packed, sz.to(torch.bfloat16), group_size, GemmConfig(16, 16, 4, 1))
    assert y.shape == (m, n)
    assert _max_rel(y, x.double() @ _f64_int4(q, sz, group_size).t()) < 1e-6


def test_interp_odd_shapes_are_refused_and_layers_fall_back(interpreted, monkeypatch):
    from jobrunner.quant.triton_mixed import int4_matmul, int8_matmul

    with pytest.raises(ValueError, match="in_features 72 is not a multiple of 64"):
        int8_matmul(torch.randn(4, 72), torch.ones(8, 72, dtype=torch.int8), torch.ones(8))
    with pytest.raises(ValueError, match="tinygemm"):
        int4_matmul(torch.randn(4, 64), torch.ones(8, 32, dtype=torch.uint8), torch.ones(2, 8, 2), 32)
    monkeypatch.setenv(TRITON_QUANT_ENV, "int8,int4")
    monkeypatch.setenv(CROSSOVER_ENV, "int8=2,int4=2")
    dispatch = dispatch_for("cpu")
    assert dispatch.triton_quant["enabled"] == ["int8", "int4"]        # probed against torch at every bucket
    torch.manual_seed(3)
    odd = Int8WeightOnlyLinear.from_linear(torch.nn.Linear(72, 16), dispatch)
    fits = Int8WeightOnlyLinear.from_linear(torch.nn.Linear(64, 24), dispatch)
    assert odd.path(9) == "dequant" and fits.path(9) == "triton" and fits.path(2) == "packed"
    x = torch.randn(9, 64)
    ref = x.double() @ fits.dequantized_weight(torch.float64).t() + fits.bias.double()
    assert _max_rel(fits(x), ref) < 1e-5


def test_interp_a_failing_kernel_falls_back_for_good(interpreted, monkeypatch, caplog):
    """Fault injection: the layer's kernel raises (as a launch on a GPU that rejects it would)."""
    from jobrunner.quant import triton_quant

    monkeypatch.setenv(TRITON_QUANT_ENV, "int8")
    monkeypatch.setenv(CROSSOVER_ENV, "int8=2")
    layer = Int8WeightOnlyLinear.from_linear(torch.nn.Linear(64, 24), dispatch_for("cpu"))
    x = torch.randn(9, 64)
    want = layer._dequant_forward(x) + layer.bias

    def broken(*args):
        raise RuntimeError("simulated launch failure")

    layer.triton_mm = broken
    torch.testing.assert_close(layer(x), want)
    assert layer.path(9) == "dequant" and "simulated launch failure" in triton_quant.failures()["int8"]
    assert caplog.text.count("triton int8 kernel failed") == 1


def test_triton_quant_is_opt_in_and_recorded(monkeypatch):
    monkeypatch.delenv(TRITON_QUANT_ENV, raising=False)
    assert requested_schemes() == () and dispatch_for("cpu").to_dict()["triton_quant"] is None
    monkeypatch.setenv(TRITON_QUANT_ENV, "fp8, int4")
    assert requested_schemes() == ("fp8", "int4")
    monkeypatch.setenv(TRITON_QUANT_ENV, "int3")
    with pytest.raises(ValueError, match="JOBRUNNER_TRITON_QUANT='int3': unknown scheme"):
        requested_schemes()


@pytest.mark.skipif(IN_CHILD or os.environ.get("TRITON_INTERPRET") == "1", reason="the parent, without CUDA")
def test_without_cuda_the_torch_path_runs_and_the_reason_is_recorded(monkeypatch):
    monkeypatch.setenv(TRITON_QUANT_ENV, "1")
    monkeypatch.setenv(CROSSOVER_ENV, "int8=2")
    dispatch = dispatch_for("cpu")
    assert dispatch.triton_quant["enabled"] == [] and dispatch.triton_quant["requested"] == ["fp8", "int8", "int4"]
    assert set(dispatch.triton_quant["reasons"].values()) == {"needs CUDA (or TRITON_INTERPRET=1), not cpu"}
    assert dispatch.to_dict()["triton_quant"] == dispatch.triton_quant
    line = describe_dispatch(dispatch.to_dict())
    assert line.endswith("; triton at batch: none (fp8 off: needs CUDA (or TRITON_INTERPRET=1), not cpu) "
                         "(int8 off: needs CUDA (or TRITON_INTERPRET=1), not cpu) (int4 off: needs CUDA "
                         "(or TRITON_INTERPRET=1), not cpu)"), line
    torch.manual_seed(4)
    lin = torch.nn.Linear(64, 24)
    layer = Int8WeightOnlyLinear.from_linear(lin, dispatch)
    assert layer.triton_mm is None and layer.path(9) == "dequant"
    x = torch.randn(9, 64)
    torch.testing.assert_close(layer(x), Int8WeightOnlyLinear.from_linear(lin)(x))
    monkeypatch.setenv("TRITON_INTERPRET", "1")                 # the interpreter allowed, triton not importable
    monkeypatch.setitem(sys.modules, "triton", None)
    reasons = dispatch_for("cpu").triton_quant["reasons"]
    assert reasons["int8"].startswith("triton is not importable")


@pytest.mark.skipif(IN_CHILD or os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiling JIT")
def test_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter skips Triton's compiler: compile each kernel to PTX for sm_90 at its largest config
    (bf16 activations, the int4 kernel at inner_k_tiles 8, the fp8 kernel writing e4m3)."""
    triton = require_import("triton", "a [test] dependency on Linux: compiles our kernels to PTX")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from jobrunner.quant.triton_fp8 import fp8_quant_rows_kernel
    from jobrunner.quant.triton_mixed import CONFIGS, int4_gemm_kernel, int8_gemm_kernel

    big = CONFIGS[-1][1]
    tiles = dict(BLOCK_M=big.block_m, BLOCK_N=big.block_n, GROUP_M=8, DOT_FP32=False)
    cases = [(fp8_quant_rows_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}, {"BLOCK_K": 4096}),
             (int8_gemm_kernel, {"a_ptr": "*bf16", "w_ptr": "*i8", "s_ptr": "*fp32", "c_ptr": "*bf16"},
              dict(tiles, BLOCK_K=64)),
             (int4_gemm_kernel, {"a_ptr": "*bf16", "p_ptr": "*i32", "sz_ptr": "*bf16", "c_ptr": "*bf16"},
              dict(tiles, H=4))]
    for kernel, pointers, consts in cases:
        signature = {name: "constexpr" if name in consts else pointers.get(name, "i32") for name in kernel.arg_names}
        source = ASTSource(fn=kernel, signature=signature,
                           constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": big.num_warps, "num_stages": big.num_stages})
        ptx = compiled.asm["ptx"]
        assert f".entry {kernel.__name__}" in ptx
        assert ("cvt.rn.satfinite.e4m3x2" in ptx) if kernel is fp8_quant_rows_kernel else ("wgmma" in ptx)
        assert compiled.metadata.shared <= 200 * 1024
