"""The fp8 KV cache (``engine.kv_cache_dtype``) at the attention level: the quantizing write and its round trip,
and every backend that reads it (torch, cpu_paged per forced capability, triton under the interpreter) against
the torch backend attending over the cache's own dequantized float32 twin.

The twin makes the comparison exact rather than statistical: after a backend's step has written its K/V into
the fp8 cache, the twin holds exactly the values the fp8 rows stand for (codes times scales), so attending over
the twin with the torch backend is what attending over the fp8 cache must give, to float32 rounding.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_cpu_paged import _backend, _layout, capability  # noqa: F401 - capability is a fixture
from tiny import engine_from_hf

from jobrunner.attention import StepUpload, make_backend
from jobrunner.attention.kv_quant import (
    FP8_DTYPES,
    SCALE_BYTES,
    cache_dtype,
    head_dim_of,
    kv_bytes_per_block,
    quantize_rows,
    read_slots,
    row_width,
    scales_of,
    write_fp8_kv,
)
from jobrunner.attention.torch_backend import TORCH_BACKEND
from jobrunner.engine import SamplingParams
from tests.triton_child import in_child, interpreted_fixture, run_in_interpreter_child

CPU = torch.device("cpu")
FORMATS = pytest.mark.parametrize("fmt", sorted(FP8_DTYPES))
# the largest relative error of one value rounded to the format (half its spacing: 3 / 2 mantissa bits)
HALF_ULP = {"fp8_e4m3": 2.0 ** -4, "fp8_e5m2": 2.0 ** -3}
MIXED = [(0, 21), (37, 6), (70, 1), (0, 1), (12, 1), (33, 2), (1030, 40), (1500, 1)]
CHILD_FLAG = "JOBRUNNER_FP8_TRITON_CHILD"
IN_CHILD = in_child(CHILD_FLAG)
interpreted = interpreted_fixture(CHILD_FLAG)


def _rows(seed: int, num: int = 40, num_kv_heads: int = 3, head_dim: int = 64) -> torch.Tensor:
    """Rows of very different magnitudes per head (1e-3, 1, 1e3: 1e3 is past e4m3's 448), a zero row, and
    one large outlier channel per row, as real keys have."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num, num_kv_heads, head_dim, generator=gen) * torch.tensor([1e-3, 1.0, 1e3])[:num_kv_heads,
                                                                                               None]
    x[:, :, 5] *= 20.0
    x[3] = 0.0
    return x


@FORMATS
def test_write_then_read_round_trip_is_within_half_a_step(fmt):
    dtype = FP8_DTYPES[fmt]
    x = _rows(1)
    k_cache = torch.zeros(64, 3, row_width(64, dtype), dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:len(x)]
    write_fp8_kv(x, -x, k_cache, v_cache, slots)
    back_k, back_v = read_slots(k_cache, slots, torch.float32), read_slots(v_cache, slots, torch.float32)
    assert head_dim_of(k_cache) == 64 and back_k.shape == x.shape
    assert torch.equal(back_v, -back_k)
    # each value within half a step of its own magnitude, or of the smallest step (subnormal codes) times its
    # row's scale: no saturation at 1e3, no underflow at 1e-3 (the per-row scale moves every row's largest value
    # to the format's largest)
    scale = scales_of(k_cache)[slots]                                    # [rows, kv_heads, 1]
    smallest = torch.tensor(1, dtype=torch.uint8).view(dtype).float()    # the smallest subnormal code
    assert torch.all((back_k - x).abs() <= HALF_ULP[fmt] * x.abs() + smallest / 2 * scale)
    assert torch.equal(back_k[3], torch.zeros(3, 64))  # a zero row stays zero (no 0 / 0)
    # a row's largest value sits exactly on the grid: its code is the format's max
    fp8_max = torch.finfo(dtype).max
    codes = k_cache[slots][..., :64].float()
    assert torch.all(codes.abs().amax(-1)[torch.arange(len(x)) != 3] == fp8_max)
    scales = scales_of(k_cache)[slots, :, 0]
    torch.testing.assert_close(scales[torch.arange(len(x)) != 3],
                               x.abs().amax(-1)[torch.arange(len(x)) != 3] / fp8_max, rtol=1e-6, atol=0)


def test_a_fixed_scale_of_one_would_saturate_where_per_row_scales_do_not():
    x = _rows(2)[:, 2:]  # the 1e3 head: far past e4m3's 448
    fixed = x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    ours = read_slots(quantize_rows(x, torch.float8_e4m3fn).view(torch.float8_e4m3fn), torch.arange(len(x)),
                      torch.float32)
    assert ((fixed - x).norm() / x.norm()) > 0.5 > 0.05 > ((ours - x).norm() / x.norm())


def test_layout_sizes_and_setting_names():
    assert row_width(64, torch.float8_e4m3fn) == 64 + SCALE_BYTES and row_width(64, torch.bfloat16) == 64
    assert cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert cache_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto|fp8_e4m3|fp8_e5m2, got 'int8'"):
        cache_dtype("int8", torch.float32)
    bf16 = kv_bytes_per_block(30, 3, 64, 16, torch.bfloat16)
    fp8 = kv_bytes_per_block(30, 3, 64, 16, torch.float8_e4m3fn)
    assert bf16 == 30 * 2 * 16 * 3 * 64 * 2 and fp8 == 30 * 2 * 16 * 3 * 68
    assert kv_bytes_per_block(32, 8, 128, 16, torch.bfloat16) / kv_bytes_per_block(32, 8, 128, 16,
                                                                                    torch.float8_e5m2) == 256 / 132


def _fp8_inputs(layout, num_slots, num_heads, num_kv_heads, head_dim, seed, fmt, dtype=torch.float32):
    """q, k, v of the step and a cache ``[2, slots, kv_heads, head_dim + 4]`` already holding quantized rows."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(layout.num_tokens, h, head_dim, generator=gen).to(dtype)
               for h in (num_heads, num_kv_heads, num_kv_heads))
    cache = torch.zeros(2, num_slots, num_kv_heads, head_dim + SCALE_BYTES, dtype=FP8_DTYPES[fmt])
    history = torch.randn(2, num_slots, num_kv_heads, head_dim, generator=gen)  # prefixes "cached"
    every = torch.arange(num_slots)
    write_fp8_kv(history[0], history[1], cache[0], cache[1], every)
    return q, k, v, cache


def _attend_fp8(backend, layout, slots, q, k, v, cache):
    """``backend``'s output over a copy of the fp8 cache, and the torch backend's over that cache's dequantized
    twin after the step's write (the reference: exactly the values the fp8 rows stand for)."""
    upload = StepUpload(CPU)
    upload.add("slot_mapping", slots)
    k_cache, v_cache = cache[0].clone(), cache[1].clone()
    got = backend.forward(q, k, v, k_cache, v_cache, backend.build(layout, upload), q.shape[-1] ** -0.5)
    every = torch.arange(k_cache.shape[0])
    twin_k, twin_v = read_slots(k_cache, every, torch.float32), read_slots(v_cache, every, torch.float32)
    index = torch.tensor(slots)
    upload = StepUpload(CPU)
    upload.add("slot_mapping", slots)
    want = TORCH_BACKEND.forward(q.float(), twin_k[index], twin_v[index], twin_k, twin_v,
                                 TORCH_BACKEND.build(layout, upload), q.shape[-1] ** -0.5)
    return got, want


@FORMATS
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads", [(16, 9, 3), (7, 8, 2)])
def test_torch_backend_reads_the_fp8_cache_as_its_dequantized_twin(fmt, block_size, num_heads, num_kv_heads):
    layout, slots, num_blocks = _layout(MIXED, block_size, random.Random(block_size))
    q, k, v, cache = _fp8_inputs(layout, num_blocks * block_size, num_heads, num_kv_heads, 64, 3, fmt)
    got, want = _attend_fp8(TORCH_BACKEND, layout, slots, q, k, v, cache)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@FORMATS
@pytest.mark.parametrize("all_native", [True, "fast", False, "fast-sdpa"])
def test_cpu_paged_reads_the_fp8_cache_in_place(capability, fmt, all_native):  # noqa: F811 - the fixture
    layout, slots, num_blocks = _layout(MIXED, 16, random.Random(5))
    q, k, v, cache = _fp8_inputs(layout, num_blocks * 16, 8, 2, 64, 5, fmt)
    got, want = _attend_fp8(_backend(8, 2, 16, 64, all_native), layout, slots, q, k, v, cache)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_cpu_paged_bf16_queries_over_an_fp8_cache(capability):  # noqa: F811 - the fixture
    layout, slots, num_blocks = _layout(MIXED, 16, random.Random(6))
    q, k, v, cache = _fp8_inputs(layout, num_blocks * 16, 9, 3, 64, 6, "fp8_e4m3", torch.bfloat16)
    backend = make_backend("cpu_paged", 9, 3, 16, CPU, head_dim=64, dtype=torch.bfloat16,
                           cache_dtype=torch.float8_e4m3fn)
    assert backend.amx is None and not backend.amx_decode  # the AMX kernels read bf16 caches only
    got, want = _attend_fp8(backend, layout, slots, q, k, v, cache)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.skipif(IN_CHILD, reason="this is the parent test")
def test_fp8_kernels_under_the_triton_interpreter():
    run_in_interpreter_child(__file__, CHILD_FLAG, "triton and not under_the",
                             "a [test] dependency on Linux: its CPU interpreter runs our attention kernels")


@FORMATS
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads", [(16, 4, 1), (32, 2, 2)])
def test_triton_reads_the_fp8_cache_in_place(interpreted, fmt, block_size, num_heads, num_kv_heads):
    rows = [(0, 21), (37, 6), (70, 1), (0, 1), (12, 1), (33, 2)]
    layout, slots, num_blocks = _layout(rows, block_size, random.Random(block_size))
    q, k, v, cache = _fp8_inputs(layout, num_blocks * block_size, num_heads, num_kv_heads, 16, 7, fmt)
    triton = make_backend("triton", num_heads, num_kv_heads, block_size, CPU)
    triton.block_n = 32  # several key iterations per row
    got, want = _attend_fp8(triton, layout, slots, q, k, v, cache)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_triton_engine_steps_over_an_fp8_cache(interpreted, hf_llama, tokenizer):
    """The engine on the triton backend with an fp8 cache, through the fixed-shape step path (what CUDA graphs
    replay) with prefix-cache hits: the torch backend's tokens over the same fp8 cache, no fall-back."""
    shared = "You are a careful assistant. Answer the question step by step. "
    prompts = [shared + "Then what?", shared + "And after that", "Hi", shared + "Why?"]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    settings = dict(block_size=16, max_num_seqs=3, max_num_batched_tokens=40, num_kv_blocks=64,
                    kv_cache_dtype="fp8_e4m3")
    want = [o.output_token_ids for o in engine_from_hf(hf_llama, tokenizer, attention_backend="torch",
                                                        **settings).generate(prompts, params)]
    engine = engine_from_hf(hf_llama, tokenizer, attention_backend="triton", static_decode=True, **settings)
    assert [o.output_token_ids for o in engine.generate(prompts, params)] == want
    stats = engine.runner.stats()
    assert stats["attention_backend"] == "triton" and stats["attention_fallbacks"] == 0
    assert stats["kv_cache_dtype"] == "float8_e4m3fn" and engine.stats().num_cached_tokens > 0


@FORMATS
def test_triton_split_decode_reads_the_fp8_cache_in_place(interpreted, fmt):
    """Decode-only steps split-K (segments of 128 keys, rows of 1 to 5 segments) over an fp8 cache."""
    rows = [(29, 1), (599, 1), (0, 1), (300, 1)]
    layout, slots, num_blocks = _layout(rows, 16, random.Random(11))
    q, k, v, cache = _fp8_inputs(layout, num_blocks * 16, 8, 2, 16, 11, fmt)
    triton = make_backend("triton", 8, 2, 16, CPU, max_model_len=1024, split_decode="on")
    triton.segment_keys = 128
    got, want = _attend_fp8(triton, layout, slots, q, k, v, cache)
    assert triton.num_split_steps == 1
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
