"""The fused CPU ops (RMSNorm with the residual add, rotary in place, SiLU * up) against the torch ops they
replace, per forced capability, float32 and bfloat16; and every fallback to the torch ops."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from jobrunner.kernels import CAPABILITY_ENV
from jobrunner.models import fused_ops
from jobrunner.models.llama import RMSNorm
from jobrunner.models.rope import apply_rotary
from tests.components import require_library

HAS_AVX2 = " avx2" in Path("/proc/cpuinfo").read_text(encoding="utf-8")


@pytest.fixture(params=["native", "avx2", "default"])
def capability(request, monkeypatch):
    if request.param != "native":
        if request.param == "avx2" and not HAS_AVX2:
            pytest.skip("this CPU has no AVX2")
        monkeypatch.setenv(CAPABILITY_ENV, request.param)
    require_library(fused_ops.fused_library())
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


# A bit-exact model of the bf16 paths in numpy float32 (one IEEE rounding per operation, as the C code without
# contraction): to_bf16 / from_bf16 of jr_numerics.h, the norm's 16 partial sums, exp_neg's polynomial.

def _to_bf16(f):
    u = np.asarray(f, np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 0x40, (u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _from_bf16(h):
    return (np.asarray(h, np.uint16).astype(np.uint32) << 16).view(np.float32)


def _round_bf16(f):
    return _from_bf16(_to_bf16(f))


def _ref_rms_norm(x, w, eps, add=None):
    r = _from_bf16(x)
    total = None
    if add is not None:
        total = _to_bf16(r + _from_bf16(add))
        r = _from_bf16(total)
    rows, n = r.shape
    vec = n - n % 16
    out = np.empty((rows, n), np.uint16)
    for t in range(rows):
        part = np.zeros(16, np.float32)
        for i in range(0, vec, 16):
            part = part + r[t, i:i + 16] * r[t, i:i + 16]
        for j, i in enumerate(range(vec, n)):
            part[j] = part[j] + r[t, i] * r[t, i]
        ss = np.float32(0)
        for j in range(16):
            ss = np.float32(ss + part[j])
        inv = np.float32(1) / np.sqrt(ss / np.float32(n) + np.float32(eps))
        out[t] = _to_bf16(_from_bf16(w) * _round_bf16(r[t] * inv))
    return out, total


def _ref_silu_mul(gate_up):
    f32 = np.float32
    g, u = np.split(_from_bf16(gate_up), 2, axis=-1)
    x = -np.abs(g)
    x = np.where(x < f32(-87), f32(-87), x)
    n = (x * f32(1.44269504089) + f32(12582912.0)) - f32(12582912.0)
    r = (x - n * f32(0.693145751953125)) - n * f32(1.428606765330187e-06)
    p = np.full_like(r, f32(1.3981999507e-3))
    for c in (8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1, 1.0, 1.0):
        p = p * r + f32(c)
    e = p * ((n.astype(np.int32) + 127) << 23).view(np.float32)
    silu = np.where(g >= 0, g, g * e) / (f32(1) + e)
    return _to_bf16(_round_bf16(silu) * u)


def _ref_rotary(x, cos, sin):
    xf, c, s = _from_bf16(x), _from_bf16(cos)[:, None, :], _from_bf16(sin)[:, None, :]
    half = xf.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    a, b = _round_bf16(x1 * c[..., :half]), _round_bf16(-x2 * s[..., :half])
    p, r = _round_bf16(x2 * c[..., half:]), _round_bf16(x1 * s[..., half:])
    return np.concatenate([_to_bf16(a + b), _to_bf16(p + r)], axis=-1)


def _bits(t):
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def _bf16(bits):
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def _assert_same_bits(got, want):
    """Equal bits, NaN where the model has NaN (which of two NaNs meeting in one operation comes out is the
    compiler's operand order, in the C code as anywhere)."""
    got_nan, want_nan = (got & 0x7FFF) > 0x7F80, (want & 0x7FFF) > 0x7F80
    assert np.array_equal(got_nan, want_nan)
    assert np.array_equal(got[~got_nan], want[~want_nan]), np.argwhere((got != want) & ~got_nan)[:5]


# Rows of ordinary values, all but the first two with a few lanes of one kind: values that are or make denormals
# (the fast bf16 path must notice and redo the row), zeros, NaN, infinities, values that overflow.
SPECIAL_KINDS = [[], [1e-39], [-3e-40, 5e-41], [1.2e-38], [-1.5e-38], [1e-20], [0.0, -0.0], [float("nan")],
                 [float("inf")], [-float("inf")], [3e38], [1e-30, -2e-37]]


def _rows_with_specials(rows, n, gen, scale=2.0):
    """Rows 2p and 2p + 1 get kind p (the norm runs rows in pairs): the first pair is clean."""
    x = torch.randn(rows, n, generator=gen).mul(scale)
    for t in range(2, rows):
        kind = SPECIAL_KINDS[t // 2 % len(SPECIAL_KINDS)]
        at = torch.randperm(n, generator=gen)[:3]  # inside the 16-lane vectors or in the tail, per row
        x[t, at] = torch.tensor(kind * 3)[:3] if kind else x[t, at]
    return _bits(x.bfloat16())


@pytest.mark.parametrize("n", [576, 120, 64])
def test_bf16_norm_is_bit_exact_with_special_lanes(capability, n):
    gen = torch.Generator().manual_seed(n)
    rows = 2 * len(SPECIAL_KINDS) + 1
    x, add = _rows_with_specials(rows, n, gen), _rows_with_specials(rows, n, gen)
    add[::3] = _to_bf16(-_from_bf16(x[::3]) * np.float32(0.999))  # sums that cancel to tiny values
    w = _bits(torch.randn(n, generator=gen).bfloat16())
    tiny_w, small_w = w.copy(), w.copy()  # small weights times small values: denormals
    tiny_w[5], small_w[6], x[0, 5], x[-1, 6] = _to_bf16([1e-30, 1e-18, 1e-9, 1e-21])  # in clean rows
    big = _bits(torch.randn(2, n, generator=gen).mul(1e8).bfloat16())  # a denormal sum, r * inv then 0
    x, add = np.concatenate([x, big]), np.concatenate([add, _to_bf16(-_from_bf16(big) * np.float32(0.5))])
    x[-2:, 7], add[-2:, 7] = _to_bf16(1.2e-38), _to_bf16(-1.0e-38)
    with torch.no_grad(), np.errstate(all="ignore"):
        for a, weight in ((None, w), (add, w), (None, tiny_w), (add, tiny_w), (None, small_w)):
            out, total = fused_ops.rms_norm(_bf16(x), _bf16(weight), 1e-5, None if a is None else _bf16(a))
            want_out, want_total = _ref_rms_norm(x, weight, 1e-5, a)
            _assert_same_bits(_bits(out), want_out)
            if a is not None:
                _assert_same_bits(_bits(total), want_total)


@pytest.mark.parametrize("inter", [1536, 120, 72])
def test_bf16_silu_mul_is_bit_exact_with_special_lanes(capability, inter):
    gen = torch.Generator().manual_seed(inter)
    rows = 2 * len(SPECIAL_KINDS) + 1
    gate_up = np.concatenate([_rows_with_specials(rows, inter, gen, 6.0), _rows_with_specials(rows, inter, gen)], 1)
    with torch.no_grad(), np.errstate(all="ignore"):
        got = fused_ops.silu_mul(_bf16(gate_up))
        _assert_same_bits(_bits(got), _ref_silu_mul(gate_up))


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 80), (2, 1, 34)])
def test_bf16_rotary_is_bit_exact_with_special_lanes(capability, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    rows = 2 * len(SPECIAL_KINDS) + 1
    qkv = _rows_with_specials(rows, (heads + 2 * kv_heads) * head_dim, gen, 1.0)
    half = head_dim // 2
    for t in range(2, rows):  # both values of a rotated pair special too (else the other product hides it)
        kind = SPECIAL_KINDS[t // 2 % len(SPECIAL_KINDS)]
        if kind:
            at = (t % heads) * head_dim + t % half
            qkv[t, [at, at + half]] = _to_bf16(np.float32(kind[0]) * np.float32([1, -0.75]))
    angle = torch.rand(rows, head_dim // 2, generator=gen).mul(100).repeat(1, 2)
    cos, sin = _bits(angle.cos().bfloat16()), _bits(angle.sin().bfloat16())
    cos[0, :4], sin[5, 7] = 0, _to_bf16(1e-38)  # exact zeros; a tiny sine (its token on the exact path)
    t = _bf16(qkv)
    q = t[:, :heads * head_dim].view(rows, heads, head_dim)
    k = t[:, heads * head_dim:(heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    with torch.no_grad(), np.errstate(all="ignore"):
        want = _ref_rotary(qkv[:, :(heads + kv_heads) * head_dim].reshape(rows, heads + kv_heads, head_dim), cos, sin)
        assert fused_ops.rotary_(q, k, _bf16(cos)[:, None, :], _bf16(sin)[:, None, :])
    got = _bits(t)
    _assert_same_bits(got[:, :(heads + kv_heads) * head_dim].reshape(want.shape), want)
    assert np.array_equal(got[:, (heads + kv_heads) * head_dim:], qkv[:, (heads + kv_heads) * head_dim:])
