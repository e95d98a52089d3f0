"""int8 / int4 weight-only layers on CUDA (tinygemm int4, int8pack or dequantize-then-GEMM). Needs a GPU."""

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
