"""Numerics of the int8 / int4 linear layers against float, on every code path (packed kernel and dequant)."""

from __future__ import annotations

import pytest
import torch

from jobrunner.quant import Int4WeightOnlyLinear, Int8WeightOnlyLinear


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def _linear(out_features: int, in_features: int, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(1)
    return torch.nn.Linear(in_features, out_features, bias=bias)


@pytest.mark.parametrize("num_tokens", [1, 8, 33])  # 1, 8: packed kernel; 33: dequantize-then-GEMM
def test_int8_close_to_float(num_tokens: int) -> None:
    lin = _linear(96, 192)
    q = Int8WeightOnlyLinear.from_linear(lin)
    x = torch.randn(num_tokens, 192)
    with torch.no_grad():
        assert _rel_err(q(x), lin(x)) < 0.02
        # Against the weight it actually holds, only bf16 activation rounding remains.
        exact = torch.nn.functional.linear(x, q.dequantized_weight(), lin.bias)
        assert _rel_err(q(x), exact) < 0.01


@pytest.mark.parametrize("num_tokens", [1, 8, 33])
@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_close_to_float(num_tokens: int, group_size: int) -> None:
    lin = _linear(96, 192)
    q = Int4WeightOnlyLinear.from_linear(lin, group_size)
    q.small_batch_max_tokens = 16  # so that 33 tokens take the unpack-then-GEMM path
    x = torch.randn(num_tokens, 192)
    with torch.no_grad():
        assert _rel_err(q(x), lin(x)) < 0.12
        exact = torch.nn.functional.linear(x, q.dequantized_weight(), lin.bias)
        assert _rel_err(q(x), exact) < 0.01


def test_paths_agree_and_keep_shape_and_dtype() -> None:
    lin = _linear(64, 128)
    for q in (Int8WeightOnlyLinear.from_linear(lin), Int4WeightOnlyLinear.from_linear(lin, 64)):
        x = torch.randn(2, 5, 128)  # 3-D input (transformers style) -> same leading dims out
        y_small = q(x)
        q.small_batch_max_tokens = 0  # force the dequantize path
        y_big = q(x)
        assert y_small.shape == (2, 5, 64) and y_small.dtype == torch.float32
        assert _rel_err(y_small, y_big) < 0.01


def test_bias_is_preserved() -> None:
    lin = _linear(32, 64)
    with torch.no_grad():
        lin.bias.fill_(3.0)
        lin.weight.zero_()
    for q in (Int8WeightOnlyLinear.from_linear(lin), Int4WeightOnlyLinear.from_linear(lin, 32)):
        assert torch.equal(q.bias, lin.bias)
        assert torch.allclose(q(torch.randn(3, 64)), torch.full((3, 32), 3.0), atol=1e-2)


def test_int4_rejects_shape_the_kernel_cannot_take() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        Int4WeightOnlyLinear.from_linear(_linear(50, 64), 32)
    with pytest.raises(ValueError, match="not a multiple of group size"):
        Int4WeightOnlyLinear.from_linear(_linear(64, 96), 64)


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (3072, 576)])  # SmolLM2 qkv, down, gate_up
def test_weight_bytes_vs_bf16(shape: tuple[int, int], int8_max: float = 0.55, int4_max: float = 0.35) -> None:
    out_features, in_features = shape
    lin = torch.nn.Linear(in_features, out_features, bias=False)
    bf16_bytes = out_features * in_features * 2
    assert Int8WeightOnlyLinear.from_linear(lin).weight_bytes() <= int8_max * bf16_bytes
    assert Int4WeightOnlyLinear.from_linear(lin, 64).weight_bytes() <= int4_max * bf16_bytes
