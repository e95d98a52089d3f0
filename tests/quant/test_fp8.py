"""fp8 (e4m3) layers on CPU: the dequantize fallback, the W8A8 reference the CUDA path follows, the scheme."""

from __future__ import annotations

import pytest
import torch

from jobrunner.quant import Fp8Linear, quantize_fp8_per_channel, quantize_model
from jobrunner.quant.dispatch import dispatch_for
from jobrunner.quant.fp8 import fp8_shape_problem
from jobrunner.quant.primitives import FP8_DTYPE, fp8_w8a8_reference, quantize_fp8_per_token
from jobrunner.spec import ModelSpec


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def _linear(out_features: int = 96, in_features: int = 160) -> torch.nn.Linear:
    torch.manual_seed(5)
    return torch.nn.Linear(in_features, out_features, bias=True)


def test_per_channel_weight_quantization_is_exact_e4m3_rounding() -> None:
    w = _linear().weight.detach()
    q, scales = quantize_fp8_per_channel(w)
    assert q.dtype == FP8_DTYPE and scales.shape == (96,)
    assert torch.equal(scales, w.abs().amax(1) / 448)
    assert torch.equal(q.float(), (w / scales[:, None]).to(FP8_DTYPE).float())
    assert torch.equal(q.float().abs().amax(1), torch.full((96,), 448.0))  # each row's max maps to 448
    assert _rel_err(q.float() * scales[:, None], w) < 0.03


def test_per_token_activation_scales() -> None:
    x = torch.randn(7, 32) * torch.arange(1, 8).float()[:, None]
    xq, s = quantize_fp8_per_token(x)
    assert s.shape == (7, 1) and torch.equal(xq.float().abs().amax(1), torch.full((7,), 448.0))
    assert _rel_err(xq.float() * s, x) < 0.03


@pytest.mark.parametrize("cap,tol", [("avx2", 1e-6), ("avx512_bf16", 1e-2)])
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_cpu_fallback_matches_its_weight(cap: str, tol: float, num_tokens: int) -> None:
    lin = _linear()
    layer = Fp8Linear.from_linear(lin, dispatch_for("cpu", cap))
    layer.tile_rows = 40  # three tiles
    x = torch.randn(num_tokens, 160)
    with torch.no_grad():
        y = layer(x)
        ref = lin(x)
    exact = torch.nn.functional.linear(x.double(), layer.dequantized_weight(torch.float64), lin.bias.double())
    assert layer.path(num_tokens) == "dequant" and y.dtype == torch.float32
    assert _rel_err(y, exact) < tol
    assert _rel_err(y, ref) < 0.03


def test_w8a8_reference_close_to_float_and_to_the_fallback() -> None:
    lin = _linear()
    layer = Fp8Linear.from_linear(lin, dispatch_for("cpu", "avx2"))
    x = torch.randn(16, 160)
    with torch.no_grad():
        w8a8 = fp8_w8a8_reference(x, layer.weight_fp8, layer.scales) + lin.bias
        assert _rel_err(w8a8, lin(x)) < 0.05
        assert _rel_err(w8a8, layer(x)) < 0.04  # the only difference: activations rounded to e4m3


def test_fp8_scheme_on_a_model(tiny_llama) -> None:
    ids = torch.arange(20).reshape(2, 10)
    with torch.no_grad():
        ref = tiny_llama(ids)
    report = quantize_model(tiny_llama, "fp8", capability="avx2")
    assert report.scheme_counts() == {"fp8": 9} and report.fallbacks == []
    expected = sum(n * k + 4 * n for n, k in (layer.shape for layer in report.layers))  # 1 byte + f32 per row
    assert report.linear_bytes_after == expected
    assert "embed_tokens quantized to int8 rows" in report.notes
    with torch.no_grad():
        assert _rel_err(tiny_llama(ids), ref) < 0.05


def test_fp8_shape_rule_and_spec() -> None:
    assert fp8_shape_problem(50, 64, torch.device("cpu")) is None
    assert "multiples of 16" in fp8_shape_problem(50, 64, torch.device("cuda"))
    assert ModelSpec(quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match="quantization"):
        ModelSpec(quantization="nf4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_bit_conversion_is_exact_for_every_value(dtype: torch.dtype) -> None:
    from jobrunner.quant.primitives import fp8_to_float_bits

    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # all but the NaNs
    q = codes.view(FP8_DTYPE).reshape(2, -1)
    out = fp8_to_float_bits(q, torch.empty(q.shape, dtype=dtype))
    assert torch.equal(out.float(), q.float())  # subnormals, zeros of both signs, +-448 included
    assert torch.equal(out.float().signbit(), q.float().signbit())
