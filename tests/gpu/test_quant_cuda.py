"""int8 / int4 / fp8 layers on CUDA (tinygemm, int8pack or int_mm, _scaled_mm, dequantize-then-GEMM). Needs a GPU."""

from __future__ import annotations

import pytest
import torch

from jobrunner.quant import Int4WeightOnlyLinear, Int8WeightOnlyLinear, quantize_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 8, 64])
def test_cuda_layers_close_to_float(dtype: torch.dtype, num_tokens: int) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(576, 960, bias=True, device="cuda", dtype=dtype)
    x = torch.randn(num_tokens, 576, device="cuda", dtype=dtype)
    with torch.no_grad():
        ref = lin(x)
        q8 = Int8WeightOnlyLinear.from_linear(lin)
        q4 = Int4WeightOnlyLinear.from_linear(lin, 32)
        y8, y4 = q8(x), q4(x)
    assert y8.dtype == dtype and y4.dtype == dtype and y4.shape == (num_tokens, 960)
    assert _rel_err(y8, ref) < 0.03
    assert _rel_err(y4, ref) < 0.12
    exact4 = torch.nn.functional.linear(x.float(), q4.dequantized_weight().float(), lin.bias.float())
    assert _rel_err(y4, exact4) < 0.02


def test_cuda_quantize_model_with_fallbacks() -> None:
    layers = [torch.nn.Linear(576, 1536), torch.nn.Linear(1536, 50), torch.nn.Linear(48, 64)]
    model = torch.nn.Sequential(*layers)
    model = model.to("cuda", torch.bfloat16)
    x = torch.randn(4, 576, device="cuda", dtype=torch.bfloat16)
    report = quantize_model(model, "int4", group_size=128)
    schemes = [layer.scheme for layer in report.layers]
    assert schemes == ["int4", "int8", "int8"]  # 576 -> group 64; N=50 not a multiple of 8; K=48 no group
    assert report.layers[0].group_size == 64
    with torch.no_grad():
        y = model[1](model[0](x))
    assert torch.isfinite(y.float()).all() and y.shape == (4, 50)


def test_cuda_int4_dispatch_tinygemm_small_dequant_large() -> None:
    from jobrunner.quant.kernels import pack_int4_cuda_reference
    from jobrunner.quant.primitives import quantize_int4_groupwise

    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
    q4 = Int4WeightOnlyLinear.from_linear(lin, 32)
    codes, _ = quantize_int4_groupwise(lin.weight, 32)
    # our reading of tinygemm's layout is the real packer's, so the large-batch path can dequantize
    assert torch.equal(q4.weight_int4pack, pack_int4_cuda_reference(codes, 8))
    assert q4.cuda_readable and q4.path(q4.small_batch_max_tokens) == "packed" and q4.path(2048) == "dequant"
    x = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        big = q4(x)
        ptr = q4.scratch._buffers[("cuda:0", torch.bfloat16)].data_ptr()
        small = q4(x[:8])
        again = q4(x)
    assert q4.scratch._buffers[("cuda:0", torch.bfloat16)].data_ptr() == ptr  # one reused bf16 buffer
    assert torch.equal(big, again)
    exact = x.float() @ q4.dequantized_weight().float().t()
    assert _rel_err(big, exact) < 0.01 and _rel_err(small, exact[:8]) < 0.02


def test_cuda_int8_small_batch_never_dequantizes() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(4096, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    q8 = Int8WeightOnlyLinear.from_linear(lin)
    del lin
    assert q8.path(1) in ("packed", "int_mm") and q8.path(q8.small_batch_max_tokens + 1) == "dequant"
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        y = q8(x)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 4 << 20  # a bf16 copy of the weight would be 32 MiB
    exact = x.float() @ q8.dequantized_weight().float().t()
    assert _rel_err(y, exact) < 0.02


def test_cuda_fp8_scaled_mm_matches_reference() -> None:
    from jobrunner.quant import Fp8Linear
    from jobrunner.quant.dispatch import cuda_fp8_supported
    from jobrunner.quant.primitives import fp8_w8a8_reference

    if not cuda_fp8_supported(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("fp8 _scaled_mm needs sm89+")
    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 1024, bias=True, device="cuda", dtype=torch.bfloat16)
    layer = Fp8Linear.from_linear(lin)
    assert layer.native and layer.path(1) == "scaled_mm"
    for num_tokens in (1, 7, 64, 300):
        x = torch.randn(num_tokens, 512, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            y = layer(x)
            ref = fp8_w8a8_reference(x, layer.weight_fp8, layer.scales) + lin.bias.float()
        assert y.shape == (num_tokens, 1024) and y.dtype == torch.bfloat16
        assert _rel_err(y, ref) < 0.01  # the same fp8 products; bf16 output rounding only
        assert _rel_err(y, lin(x)) < 0.06


def test_cuda_triton_quant_kernels_opt_in(monkeypatch) -> None:
    """JOBRUNNER_TRITON_QUANT=1: each scheme's Triton path is probed, chosen at batch and matches torch's."""
    from jobrunner.quant import dispatch_for
    from jobrunner.quant.dispatch import cuda_fp8_supported

    monkeypatch.setenv("JOBRUNNER_TRITON_QUANT", "1")
    dispatch = dispatch_for("cuda")
    choice = dispatch.triton_quant
    assert set(choice["enabled"]) | set(choice["reasons"]) == {"fp8", "int8", "int4"}
    assert {"int8", "int4"} <= set(choice["enabled"]), choice["reasons"]
    # fp8 is on exactly where the GPU has fp8 (sm89+); its numbers are the next test's
    fp8_here = cuda_fp8_supported(torch.device("cuda", torch.cuda.current_device()))
    assert ("fp8" in choice["enabled"]) == fp8_here, choice["reasons"]
    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 768, bias=True, device="cuda", dtype=torch.bfloat16)
    q8 = Int8WeightOnlyLinear.from_linear(lin, dispatch)
    q4 = Int4WeightOnlyLinear.from_linear(lin, 32, dispatch)
    for num_tokens in (33, 100, 257):      # three M buckets, none a multiple of its block
        x = torch.randn(num_tokens, 1024, device="cuda", dtype=torch.bfloat16)
        assert q8.path(num_tokens) == "triton" and q4.path(num_tokens) == "triton"
        with torch.no_grad():
            y8, y4 = q8(x), q4(x)
        exact8 = x.float() @ q8.dequantized_weight().float().t() + lin.bias.float()
        exact4 = x.float() @ q4.dequantized_weight().float().t() + lin.bias.float()
        assert _rel_err(y8, exact8) < 0.01 and _rel_err(y4, exact4) < 0.01
    from jobrunner.quant.triton_quant import failures
    assert failures() == {}


def test_cuda_triton_fp8_opt_in(monkeypatch) -> None:
    """JOBRUNNER_TRITON_QUANT=1 on an fp8 GPU: fp8 is probed, chosen at a small batch and matches the reference."""
    from jobrunner.quant import Fp8Linear, dispatch_for
    from jobrunner.quant.dispatch import cuda_fp8_supported
    from jobrunner.quant.primitives import fp8_w8a8_reference
    from jobrunner.quant.triton_quant import failures

    if not cuda_fp8_supported(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("fp8 needs sm89+")
    monkeypatch.setenv("JOBRUNNER_TRITON_QUANT", "1")
    dispatch = dispatch_for("cuda")
    assert "fp8" in dispatch.triton_quant["enabled"], dispatch.triton_quant["reasons"]
    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 768, bias=True, device="cuda", dtype=torch.bfloat16)
    f8 = Fp8Linear.from_linear(lin, dispatch)
    assert f8.path(5) == "triton_scaled_mm"
    x = torch.randn(5, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = fp8_w8a8_reference(x, f8.weight_fp8, f8.scales) + lin.bias.float()
        assert _rel_err(f8(x), ref) < 0.01
    assert failures() == {}


def test_cuda_triton_quant_under_graph_capture(monkeypatch) -> None:
    """The Triton paths capture into a CUDA graph (the engine replays decode steps) and replay the same."""
    from jobrunner.quant import dispatch_for

    monkeypatch.setenv("JOBRUNNER_TRITON_QUANT", "int8,int4")
    dispatch = dispatch_for("cuda")
    lin = torch.nn.Linear(1024, 512, bias=False, device="cuda", dtype=torch.bfloat16)
    layers = [Int8WeightOnlyLinear.from_linear(lin, dispatch), Int4WeightOnlyLinear.from_linear(lin, 32, dispatch)]
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = [layer(x) for layer in layers]      # compiles before capture, as the load-time probe does
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [layer(x) for layer in layers]
        graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs, eager):
        assert torch.equal(got, want)
