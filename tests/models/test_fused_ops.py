"""The fused CPU ops (RMSNorm with the residual add, rotary in place, SiLU * up) against the torch ops they
replace, per forced capability, float32 and bfloat16; and every fallback to the torch ops."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jobrunner.models import fused_ops
from jobrunner.models.llama import RMSNorm
from jobrunner.models.rope import apply_rotary
from jobrunner.quant.capability import CAPABILITY_ENV
from tests.components import missing_component

HAS_AVX2 = " avx2" in Path("/proc/cpuinfo").read_text(encoding="utf-8")


@pytest.fixture(params=["native", "avx2", "default"])
def capability(request, monkeypatch):
    if request.param != "native":
        if request.param == "avx2" and not HAS_AVX2:
            pytest.skip("this CPU has no AVX2")
        monkeypatch.setenv(CAPABILITY_ENV, request.param)
    lib = fused_ops.fused_library()
    if isinstance(lib, str):
        missing_component(lib)
    return request.param


def _close(got, want, dtype):
    if dtype == torch.bfloat16:  # float32 inside, one rounding: at most one bf16 step apart
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=8e-3)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,size", [(1, 576), (77, 576), (300, 4096), (5, 72)])
def test_rms_norm_with_and_without_the_residual_add(capability, dtype, rows, size):
    gen = torch.Generator().manual_seed(rows + size)
    norm = RMSNorm(size, 1e-5)
    norm.weight.data = torch.randn(size, generator=gen).to(dtype)
    x, add = (torch.randn(rows, size, generator=gen).mul(3).to(dtype) for _ in range(2))
    with torch.no_grad():
        out, same = fused_ops.rms_norm(x, norm.weight, 1e-5)
        assert same is x
        _close(out, norm.reference(x), dtype)
        out, total = fused_ops.rms_norm(x, norm.weight, 1e-5, add)
        assert torch.equal(total, x + add)  # the residual sum, rounded to the dtype as torch rounds it
        _close(out, norm.reference(x + add), dtype)
        got_out, got_total = norm.add_forward(x, add)
        assert torch.equal(got_out, out) and torch.equal(got_total, total)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 80)])
def test_rotary_in_place_on_qkv_views_is_exactly_the_torch_result(capability, dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads * head_dim)
    rows = 37
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, :heads * head_dim].view(rows, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    cos, sin = (torch.randn(rows, 1, head_dim, generator=gen).to(dtype) for _ in range(2))
    want_q, want_k = apply_rotary(q.clone(), k.clone(), cos, sin)
    with torch.no_grad():
        assert fused_ops.rotary_(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 1536), (64, 1536), (9, 100)])
def test_silu_mul_matches_torch(capability, dtype, rows, inter):
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter, generator=gen).mul(6).to(dtype)  # tails of both signs
    gate_up[0, :4] = torch.tensor([0.0, -90.0, 90.0, -1e-30])
    gate, up = gate_up.split(inter, dim=-1)
    with torch.no_grad():
        got = fused_ops.silu_mul(gate_up)
    _close(got, torch.nn.functional.silu(gate) * up, dtype)


def test_fallbacks_leave_the_torch_ops_in_charge(monkeypatch):
    x = torch.randn(4, 64)
    w = torch.randn(64)
    assert fused_ops.rms_norm(x.t().contiguous().t(), w, 1e-5) is None  # not contiguous
    assert fused_ops.rms_norm(x.half(), w.half(), 1e-5) is None          # float16
    assert fused_ops.rms_norm(x, w.bfloat16(), 1e-5) is None             # mixed dtypes
    assert fused_ops.silu_mul(torch.randn(4, 7)) is None                 # odd width
    grad = torch.randn(4, 128, requires_grad=True)
    assert fused_ops.silu_mul(grad) is None                              # autograd wants the torch ops
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    assert not fused_ops.rotary_(q.transpose(1, 2), k, torch.randn(3, 1, 8), torch.randn(3, 1, 8))
    monkeypatch.setenv(fused_ops.FUSED_ENV, "0")
    assert fused_ops.rms_norm(x, w, 1e-5) is None and fused_ops.silu_mul(torch.randn(4, 8)) is None
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        assert torch.equal(norm(x), norm.reference(x))


def test_no_compiler_means_torch_ops(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv(CAPABILITY_ENV, "default")
    monkeypatch.setenv("XDG_CACHE_HOME", "/nonexistent-cache")
    fused_ops._library.cache_clear()
    try:
        assert "no C compiler" in fused_ops.fused_library()
        assert fused_ops.silu_mul(torch.randn(2, 8)) is None
    finally:
        fused_ops._library.cache_clear()


def test_bf16_vector_lanes_and_the_scalar_tail_agree_bit_for_bit(capability):
    """Rows of 17 equal values: 16 run in the vector lanes, the 17th in the scalar tail; every output of a row has
    the same bits, for ordinary values and NaN, infinities, -0 and bf16 denormals."""
    specials = [0.0, -0.0, 1.0, -2.5, 90.0, -90.0, 1e-39, -1e-39, 3.3e38, float("inf"), -float("inf"),
                float("nan"), 0.0078125, -7.0]
    col = torch.tensor(specials).bfloat16()[:, None]
    gate_up = torch.cat([col.expand(-1, 17), col.flip(0).expand(-1, 17)], dim=1).contiguous()
    with torch.no_grad():
        out = fused_ops.silu_mul(gate_up).view(torch.int16)
        x = col.expand(-1, 17).contiguous()
        add = col.flip(0).expand(-1, 17).contiguous()
        weight = torch.full((17,), 1.5).bfloat16()
        normed, total = fused_ops.rms_norm(x, weight, 1e-5, add)
        plain, _ = fused_ops.rms_norm(x, weight, 1e-5)
    for result in (out, normed.view(torch.int16), total.view(torch.int16), plain.view(torch.int16)):
        assert torch.equal(result, result[:, :1].expand_as(result)), result
