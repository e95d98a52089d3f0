"""Split-K decode attention (jobrunner/attention/split_decode.py): the rule on its own, and the two kernels (run by
Triton's CPU interpreter in a child pytest, as in test_attention_backends.py) against the torch backend."""

from __future__ import annotations

import os
import random

import pytest
import torch
from tiny import engine_from_hf

from jobrunner.attention import StepLayout, StepUpload, make_backend
from jobrunner.attention.split_decode import (
    MAX_SEGMENTS,
    SEGMENT_KEYS,
    check_split_mode,
    segment_keys_for,
    use_split_decode,
)
from jobrunner.attention.torch_backend import TORCH_BACKEND
from jobrunner.attention.triton_backend import TritonBackend
from jobrunner.bench.kv_attention import decode_layout
from jobrunner.engine import EngineConfig, SamplingParams
from tests.triton_child import in_child, interpreted_fixture, run_in_interpreter_child

CHILD_FLAG = "JOBRUNNER_SPLIT_CHILD"
IN_CHILD = in_child(CHILD_FLAG)
interpreted = interpreted_fixture(CHILD_FLAG)


@pytest.mark.skipif(IN_CHILD, reason="this is the parent test")
def test_split_kernels_under_the_triton_interpreter():
    run_in_interpreter_child(__file__, CHILD_FLAG, "interp and not under_the",
                             "a [test] dependency on Linux: its CPU interpreter runs our split-K attention kernels")


# -- the rule and the segment (no triton needed) ---------------------------------------------------------------


def test_rule_splits_small_grids_with_long_rows_only():
    # Llama-3-8B on an H200: 8 kv heads, 264 programs wanted, 512-key segments
    assert use_split_decode(4, 8, 4096, 512, 264)             # 32 programs, 8 segments: split
    assert use_split_decode(32, 8, 513, 512, 264)             # 256 programs < 264, two segments
    assert not use_split_decode(33, 8, 4096, 512, 264)        # 264 programs fill the GPU already
    assert not use_split_decode(4, 8, 512, 512, 264)          # one segment: nothing to split
    assert not use_split_decode(256, 8, 8192, 512, 264)       # the big batch


def test_segment_is_a_multiple_of_block_and_tile_and_bounds_the_segments():
    assert segment_keys_for(16, 64, 8192) == SEGMENT_KEYS
    assert segment_keys_for(48, 64, 8192) == 576                       # lcm(48, 64) = 192 -> 3 x 192
    keys = segment_keys_for(16, 64, 131072)
    assert keys % 64 == 0 and -(-131072 // keys) <= MAX_SEGMENTS and keys == 2048
    assert check_split_mode("auto") == "auto"
    with pytest.raises(ValueError, match="split_decode"):
        check_split_mode("yes")
    with pytest.raises(ValueError, match="split_decode"):
        EngineConfig(split_decode="always")


def test_backend_chooses_segments_per_mode():
    rng = random.Random(0)
    decode, _ = decode_layout([30, 300, 5], 16, 64, rng)
    chunk = StepLayout([0], [7], [7], [[1]], 7, 16)
    backend = TritonBackend(8, 2, 16, torch.device("cpu"), max_model_len=1024, split_decode="auto", segment_keys=128)
    assert backend.max_segments == 8 and backend.target_programs == 256
    assert backend.num_segments(decode, 3, fixed=False) == 3                  # 6 programs < 256, 300 keys
    assert backend.num_segments(decode, 3, fixed=True) == 8                   # a graph's grid: every segment
    assert backend.num_segments(decode, 128, fixed=False) == 0                # 256 programs: the GPU is full
    assert backend.num_segments(chunk, 1, fixed=False) == 0                   # a prompt chunk never splits
    short, _ = decode_layout([100, 20], 16, 64, rng)
    assert backend.num_segments(short, 2, fixed=False) == 0                   # one segment: no split
    backend.split_decode = "on"
    assert backend.num_segments(short, 2, fixed=False) == 1 and backend.num_segments(decode, 128, False) == 3
    backend.fixed_tiles = True                                                # deterministic mode: never
    assert backend.num_segments(decode, 3, fixed=False) == 0 and not backend.may_split(1)
    backend = TritonBackend(8, 2, 16, torch.device("cpu"), split_decode="off")
    assert backend.num_segments(decode, 3, fixed=False) == 0


# -- the kernels, interpreted ---------------------------------------------------------------------------------


def _attend(backend, layout, slots, q, k, v, cache):
    upload = StepUpload(q.device)
    upload.add("slot_mapping", slots)
    meta = backend.build(layout, upload)
    k_cache, v_cache = cache[0].clone(), cache[1].clone()
    return backend.forward(q, k, v, k_cache, v_cache, meta, q.shape[-1] ** -0.5), meta


# segment 64 keys, block 16 (32 for some): a row of 1 key, rows ending just before / at / after a segment and a
# block boundary, one much longer than the others, one shorter than a segment
LENGTHS = [1, 5, 63, 64, 65, 128, 129, 250, 16, 17]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)])
def test_interp_split_matches_torch_float32(interpreted, block_size, num_heads, num_kv_heads):
    rng = random.Random(block_size + num_heads)
    torch.manual_seed(num_heads * 7 + block_size)
    head_dim, num_blocks = 16, 64
    layout, slots = decode_layout(LENGTHS, block_size, num_blocks, rng)
    cache = torch.randn(2, num_blocks * block_size, num_kv_heads, head_dim)
    q = torch.randn(layout.num_tokens, num_heads, head_dim)
    k = torch.randn(layout.num_tokens, num_kv_heads, head_dim)
    v = torch.randn(layout.num_tokens, num_kv_heads, head_dim)
    split = make_backend("triton", num_heads, num_kv_heads, block_size, torch.device("cpu"), max_model_len=512,
                         split_decode="on")
    split.segment_keys, split.block_n = 64, 32                  # two key iterations per segment, 4 segments max
    got, meta = _attend(split, layout, slots, q, k, v, cache)
    assert meta.num_segments == 4
    want, _ = _attend(TORCH_BACKEND, layout, slots, q, k, v, cache)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_interp_split_bfloat16_within_tolerance(interpreted):
    rng = random.Random(9)
    layout, slots = decode_layout([300, 7, 129], 16, 48, rng)
    torch.manual_seed(9)
    cache = torch.randn(2, 48 * 16, 2, 16).bfloat16()
    q, k, v = (torch.randn(layout.num_tokens, h, 16).bfloat16() for h in (8, 2, 2))
    split = make_backend("triton", 8, 2, 16, torch.device("cpu"), max_model_len=512, split_decode="on")
    split.segment_keys = 128
    got, meta = _attend(split, layout, slots, q, k, v, cache)
    assert got.dtype == torch.bfloat16 and meta.num_segments == 3
    want, _ = _attend(TORCH_BACKEND, layout, slots, q.float(), k.float(), v.float(), cache.float())
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_interp_fixed_grid_with_padding_rows_matches_the_unsplit_kernel(interpreted):
    """A CUDA graph's grid: padded rows (seq_len 0) and every segment a row could have; padding rows stay 0."""
    from jobrunner.attention.triton_backend import TritonMetadata

    rng = random.Random(4)
    layout, slots = decode_layout([70, 3, 190], 16, 32, rng)
    torch.manual_seed(4)
    cache = torch.randn(2, 32 * 16, 2, 16)
    q = torch.randn(8, 4, 16)                                           # 3 real tokens, 5 padding tokens
    k, v = torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    outs = []
    for mode in ("on", "off"):
        backend = TritonBackend(4, 2, 16, torch.device("cpu"), max_num_seqs=8, max_model_len=256,
                                split_decode=mode, segment_keys=64)
        upload = StepUpload(torch.device("cpu"))
        upload.add("slot_mapping", slots + [31 * 16] * 5)
        block_m = backend.block_m(1)
        backend.add_arrays(layout, upload, block_m, num_rows=8, num_tiles=16)
        t = upload.flush()
        backend.tables.apply(t)
        segments = backend.num_segments(layout, 8, fixed=True)
        meta = TritonMetadata(backend, t, 8, block_m, covers_all_tokens=False, num_segments=segments)
        outs.append((segments, backend.forward(q, k, v, cache[0].clone(), cache[1].clone(), meta, 0.25)))
    (segments, split), (_, whole) = outs
    assert segments == 4
    torch.testing.assert_close(split, whole, atol=2e-5, rtol=1e-4)
    assert (split[3:] == 0).all()


def test_interp_engine_split_through_the_step_graph_twin_matches_torch(interpreted, hf_llama, tokenizer):
    """Whole engine, triton attention split-K on every decode step through the fixed-shape path (what CUDA
    graphs replay): rows of different lengths cross several 32-key segments; the torch backend's tokens."""
    prompts = ["The quick brown fox jumps over the lazy dog. " * 2, "Hi", "Why is the sky blue? Tell me."]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    settings = dict(block_size=16, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=32, max_model_len=128)
    want = [o.output_token_ids for o in engine_from_hf(hf_llama, tokenizer, **settings).generate(prompts, params)]
    engine = engine_from_hf(hf_llama, tokenizer, attention_backend="triton", static_decode=True,
                            split_decode="on", **settings)
    backend = engine.runner.backend
    backend.segment_keys, backend.max_segments = 32, 4                  # 128 keys at most: 4 segments
    assert [o.output_token_ids for o in engine.generate(prompts, params)] == want
    stats = engine.runner.stats()
    assert stats["attention_backend"] == "triton" and stats["attention_fallbacks"] == 0
    assert stats["static_eager_steps"] == engine.stats().steps
    assert stats["split_decode"] == "on" and 0 < stats["split_decode_steps"] < engine.stats().steps


def test_interp_late_readback_through_the_step_graph_twin(interpreted, hf_llama, tokenizer):
    """Late readback on the triton fixed-shape path (the ids patched into the persistent buffer outside the
    graph), split-K on: the synchronous torch engine's tokens, rows stopping on tokens the host reads late."""
    prompts = ["The quick brown fox jumps over the lazy dog.", "Hi", "Why is the sky blue?", "One two"]
    settings = dict(block_size=16, max_num_seqs=3, max_num_batched_tokens=64, num_kv_blocks=32, max_model_len=128,
                    speculative="off")
    free = engine_from_hf(hf_llama, tokenizer, **settings).generate(
        prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                             stop_token_ids=[o.output_token_ids[3 + i]]) for i, o in enumerate(free)]
    want = [o.output_token_ids for o in engine_from_hf(hf_llama, tokenizer, **settings).generate(prompts, params)]
    engine = engine_from_hf(hf_llama, tokenizer, attention_backend="triton", static_decode=True,
                            split_decode="on", late_readback="always", **settings)
    engine.runner.backend.segment_keys, engine.runner.backend.max_segments = 32, 4
    assert [o.output_token_ids for o in engine.generate(prompts, params)] == want
    stats = engine.stats()
    assert stats.num_late_steps > 0 and stats.num_late_discarded_tokens > 0
    assert stats.num_fixed_shape_steps == stats.steps and engine.runner.stats()["attention_fallbacks"] == 0


@pytest.mark.skipif(IN_CHILD or os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiling JIT")
@pytest.mark.parametrize("cache", ["bf16", "fp8e4nv", "fp8e5", "fp32"])
def test_split_kernels_compile_for_hopper_without_a_gpu(cache):
    """Compile both kernels to PTX for sm_90 (no GPU needed): bf16, head_dim 128, GQA 4 (Llama-3-8B), over a bf16
    cache and over fp8 caches (codes with float32 row scales: engine.kv_cache_dtype); and float32 throughout
    (DOT_FP32), as the GPU check's float32 parity runs them."""
    from tests.components import require_import

    triton = require_import("triton", "a [test] dependency on Linux: compiles our kernels to PTX")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from jobrunner.attention.triton_split_kernels import merge_segments_kernel, split_decode_kernel

    fp32 = cache == "fp32"
    act = "*fp32" if fp32 else "*bf16"
    cases = ((split_decode_kernel, dict(N_REP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=16, BLOCK_N=64, SEGMENT=512,
                                        BLOCK_SIZE=16, DOT_FP32=fp32, KV_SCALED=cache not in ("bf16", "fp32"))),
             (merge_segments_kernel, dict(HEAD_DIM=128, BLOCK_D=128, SEGMENT=512, BLOCK_S=16)))
    for kernel, consts in cases:
        floats = {"part_m_ptr", "part_l_ptr", "part_acc_ptr", "ks_ptr", "vs_ptr"}
        signature = {name: "constexpr" if name in consts else "*fp32" if name in floats else f"*{cache}"
                     if name in ("k_ptr", "v_ptr") else act if name in ("q_ptr", "o_ptr") else "*i64"
                     if name.endswith("_ptr") else "fp32" if name == "scale" else "i32" for name in kernel.arg_names}
        source = ASTSource(fn=kernel, signature=signature,
                           constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert f".entry {kernel.__name__}" in compiled.asm["ptx"]
