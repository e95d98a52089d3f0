"""The triton attention backend (run by Triton's CPU interpreter) against the torch backend, and selection.

Triton decides at import time whether its kernels are interpreted, so the kernel tests run in a child pytest
started with ``TRITON_INTERPRET=1`` (``test_kernels_under_the_triton_interpreter``); in the parent process
they are skipped, and the parent test fails with the child's output if any of them fails.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F
from tiny import engine_from_hf

from jobrunner.attention import StepLayout, StepUpload, make_backend
from jobrunner.attention.torch_backend import TORCH_BACKEND
from jobrunner.engine import EngineConfig, SamplingParams
from tests.components import require_import
from tests.triton_child import in_child, interpreted_fixture, run_in_interpreter_child

CHILD_FLAG = "JOBRUNNER_TRITON_CHILD"
IN_CHILD = in_child(CHILD_FLAG)
interpreted = interpreted_fixture(CHILD_FLAG)


@pytest.mark.skipif(IN_CHILD, reason="this is the parent test")
def test_kernels_under_the_triton_interpreter():
    run_in_interpreter_child(__file__, CHILD_FLAG, "triton and not fallback and not under_the",
                             "a [test] dependency on Linux: its CPU interpreter runs our attention kernels")


def _layout(rows, block_size, num_blocks, rng):
    """rows: (start, query_len) per row -> a StepLayout with shuffled block tables, and its slot list."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    layout = StepLayout([], [], [], [], 0, block_size)
    slots = []
    for start, q_len in rows:
        seq_len = start + q_len
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        layout.query_starts.append(layout.num_tokens)
        layout.query_lens.append(q_len)
        layout.seq_lens.append(seq_len)
        layout.block_tables.append(table)
        layout.num_tokens += q_len
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, seq_len)]
    return layout, slots


def _attend(backend, layout, slots, q, k, v, cache):
    upload = StepUpload(q.device)
    upload.add("slot_mapping", slots)
    meta = backend.build(layout, upload)
    k_cache, v_cache = cache[0].clone(), cache[1].clone()
    return backend.forward(q, k, v, k_cache, v_cache, meta, q.shape[-1] ** -0.5), k_cache


# prompt chunk from 0 | chunk after a cached prefix | long decode | short decodes | a one-token chunk tail
MIXED = [(0, 21), (37, 6), (70, 1), (0, 1), (12, 1), (33, 2)]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 1), (8, 1)])
def test_triton_matches_torch_on_mixed_steps(interpreted, block_size, num_heads, num_kv_heads):
    rng = random.Random(block_size * 10 + num_heads)
    torch.manual_seed(block_size + num_heads)
    head_dim, num_blocks = 16, 24
    layout, slots = _layout(MIXED, block_size, num_blocks, rng)
    cache = torch.randn(2, num_blocks * block_size, num_kv_heads, head_dim)   # prefixes already "cached"
    q = torch.randn(layout.num_tokens, num_heads, head_dim)
    k = torch.randn(layout.num_tokens, num_kv_heads, head_dim)
    v = torch.randn(layout.num_tokens, num_kv_heads, head_dim)
    triton = make_backend("triton", num_heads, num_kv_heads, block_size, torch.device("cpu"))
    triton.block_n = 32  # several key iterations per row even at these lengths
    got, got_cache = _attend(triton, layout, slots, q, k, v, cache)
    want, want_cache = _attend(TORCH_BACKEND, layout, slots, q, k, v, cache)
    assert torch.equal(got_cache, want_cache)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_triton_bfloat16_matches_float32_torch(interpreted):
    rng = random.Random(5)
    layout, slots = _layout(MIXED, 16, 24, rng)
    torch.manual_seed(5)
    cache = torch.randn(2, 24 * 16, 2, 16).bfloat16()
    q, k, v = (torch.randn(layout.num_tokens, h, 16).bfloat16() for h in (8, 2, 2))
    triton = make_backend("triton", 8, 2, 16, torch.device("cpu"))
    got, _ = _attend(triton, layout, slots, q, k, v, cache)
    want, _ = _attend(TORCH_BACKEND, layout, slots, q.float(), k.float(), v.float(), cache.float())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_triton_decode_only_and_prefill_only_steps(interpreted):
    rng = random.Random(3)
    for rows in ([(5, 1), (40, 1), (16, 1)], [(0, 40)], [(16, 30)]):
        layout, slots = _layout(rows, 16, 16, rng)
        cache = torch.randn(2, 16 * 16, 2, 16)
        q, k, v = (torch.randn(layout.num_tokens, h, 16) for h in (8, 2, 2))
        triton = make_backend("triton", 8, 2, 16, torch.device("cpu"))
        got, _ = _attend(triton, layout, slots, q, k, v, cache)
        want, _ = _attend(TORCH_BACKEND, layout, slots, q, k, v, cache)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_triton_engine_with_step_graph_twin_matches_torch(interpreted, hf_llama, tokenizer):
    """Whole engine: triton attention through the fixed-shape step path (what CUDA graphs replay), with
    chunked prefill, prefix-cache hits and decodes sharing steps, gives the torch backend's tokens."""
    shared = "The quick brown fox jumps over the lazy dog. " * 3
    prompts = [shared + "Then what?", shared + "And after that", "Hi", shared + "Why?"]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    settings = dict(block_size=16, max_num_seqs=3, max_num_batched_tokens=40, num_kv_blocks=64)
    want = [o.output_token_ids for o in engine_from_hf(hf_llama, tokenizer, **settings).generate(prompts, params)]
    engine = engine_from_hf(hf_llama, tokenizer, attention_backend="triton", static_decode=True, **settings)
    got = [o.output_token_ids for o in engine.generate(prompts, params)]
    assert got == want
    stats = engine.runner.stats()
    assert stats["attention_backend"] == "triton" and stats["attention_fallbacks"] == 0
    assert stats["static_eager_steps"] == engine.stats().steps == engine.stats().num_fixed_shape_steps
    assert engine.stats().num_cached_tokens > 0   # some rows started past position 0


def test_triton_sibling_samples_read_their_own_kv(interpreted, tokenizer):
    """n > 1: each sample has its own block table (its own device table row), so the triton backend gives
    the torch backend's tokens for every sample. head_dim 128, block size 4: contexts span several blocks.
    Through the fixed-shape step path (what CUDA graphs replay; the eager path shares its block tables)."""
    from tiny import CORPUS, make_hf_model

    hf = make_hf_model("llama", hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                       intermediate_size=128, num_hidden_layers=1)
    prompts = [CORPUS[1][:40], CORPUS[2][:30]]
    params = [SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True),
              SamplingParams(n=2, max_tokens=6, temperature=0, ignore_eos=True)]
    settings = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=96)

    def tokens(engine):
        return [o.output_token_ids for o in engine.generate(prompts, params)]   # r0 samples 0-2, r1 samples 0-1

    want = tokens(engine_from_hf(hf, tokenizer, **settings))
    engine = engine_from_hf(hf, tokenizer, attention_backend="triton", static_decode=True, **settings)
    got = tokens(engine)
    assert len(want) == 5 and len({tuple(t) for t in want[:3]}) == 3   # the seeded samples differ
    assert got == want
    assert engine.runner.stats()["attention_fallbacks"] == 0


def test_triton_failed_graph_capture_runs_eagerly(interpreted, hf_llama, tokenizer, monkeypatch, caplog):
    """Graph capture on a machine without CUDA fails: one warning, a counter, the same tokens as torch."""
    from jobrunner.engine.llm_engine import LLMEngine

    prompts = ["one two three four", "five six"]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    want = [o.output_token_ids for o in engine_from_hf(hf_llama, tokenizer).generate(prompts, params)]
    monkeypatch.setattr(LLMEngine, "_decode_graphs_mode", lambda self: "cuda")
    engine = engine_from_hf(hf_llama, tokenizer, attention_backend="triton")
    assert [o.output_token_ids for o in engine.generate(prompts, params)] == want
    stats = engine.runner.stats()
    assert stats["attention_backend"] == "triton" and stats["graphs_captured"] == 0
    assert stats["graph_capture_failures"] == 2    # the prefill bucket and the 2-row decode bucket, once each
    assert caplog.text.count("CUDA graph capture failed") == 1
    assert engine.stats().num_fixed_shape_steps == 0


def test_triton_without_cuda_falls_back_to_torch(monkeypatch, hf_llama, tokenizer, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    engine = engine_from_hf(hf_llama, tokenizer, attention_backend="triton")
    assert engine.runner.stats() == {"attention_backend": "torch", "attention_fallbacks": 1,
                                     "attention_backend_requested": "triton"}  # (+ kv_cache_dtype when fp8)
    assert "needs CUDA" in caplog.text
    out = engine.generate(["one two three"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].output_token_ids) == 3


@pytest.mark.skipif(IN_CHILD or os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiling JIT")
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("cache", ["bf16", "fp8e4nv", "fp8e5", "fp32"])
def test_kernel_compiles_for_hopper_without_a_gpu(block_m, cache):
    """The interpreter skips Triton's compiler; compile to PTX for sm_90 (no GPU needed) to catch what only
    the compiler rejects. bf16, head_dim 128, GQA 4: the Llama-3-8B decode (16) and prompt-chunk (64) tiles,
    over a bf16 cache and over fp8 caches (e4m3 / e5m2 codes with float32 row scales: engine.kv_cache_dtype);
    and float32 throughout with exact float32 products (DOT_FP32), as scripts/gpu_check.sh's float32 parity
    runs it (head_dim 128, GQA 4)."""
    triton = require_import("triton", "a [test] dependency on Linux: compiles our kernels to PTX")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from jobrunner.attention.triton_kernels import paged_attention_kernel as kernel

    fp32 = cache == "fp32"
    act = "*fp32" if fp32 else "*bf16"
    consts = dict(N_REP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=block_m, BLOCK_N=64, TOKENS_PER_TILE=block_m // 4,
                  BLOCK_SIZE=16, DOT_FP32=fp32, KV_SCALED=cache not in ("bf16", "fp32"))
    pointer = {"q_ptr": act, "k_ptr": f"*{cache}", "v_ptr": f"*{cache}", "o_ptr": act, "ks_ptr": "*fp32",
               "vs_ptr": "*fp32"}
    signature = {name: "constexpr" if name in consts else pointer.get(name) or (
        "*i64" if name.endswith("_ptr") else "fp32" if name == "scale" else "i32") for name in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert ".entry paged_attention_kernel" in compiled.asm["ptx"]
    # bf16 / fp8 leave room for two programs per SM; float32 (a parity check, not a speed path) must fit sm_90's
    # 227 KiB a block may use
    assert compiled.metadata.shared <= (227 if fp32 else 64) * 1024


def test_device_block_tables_send_only_new_blocks():
    from jobrunner.attention.block_tables import DeviceBlockTables

    tables = DeviceBlockTables(capacity=2, max_blocks=4, device=torch.device("cpu"))

    def step(keys, lists):
        upload = StepUpload(torch.device("cpu"))
        rows, triples = tables.updates(keys, lists)
        tables.add_to(upload, triples)
        tables.apply(upload.flush())
        return rows, triples

    a, b = [7, 3], [5]
    assert step(["a", "b"], [a, b]) == ([0, 1], ([0, 0, 1], [0, 1, 0], [7, 3, 5]))
    a.append(9)                                                    # a grows by one block: one triple
    assert step(["a", "b"], [a, b]) == ([0, 1], ([0], [2], [9]))
    assert tables.table[0, :3].tolist() == [7, 3, 9] and tables.table[1, 0] == 5
    assert step(["a"], [[1, 2]]) == ([0], ([0, 0], [0, 1], [1, 2]))  # a replaced list (preempted): whole
    b[0] = 6                                                       # an in-place change of a synced block
    assert step(["b"], [b]) == ([1], ([1], [0], [6]))
    assert step(["c"], [[4]]) == ([0], ([0], [0], [4]))            # full: c takes a's row (least recent)
    assert step(["a"], [[1, 2]])[1] == ([1, 1], [0, 1], [1, 2])    # a comes back: synced again, b's row
    tables.release("a")                                            # a finished: its row is free at once
    assert step([("r", 0), ("r", 1)], [[8], [9]]) == ([1, 0], ([1, 0], [0, 0], [8, 9]))  # two samples, two rows
    with pytest.raises(ValueError, match="share a block-table key"):
        step(["x", "x"], [[1], [2]])
    with pytest.raises(ValueError, match="4 columns"):
        step(["d"], [[1, 2, 3, 4, 5]])


def test_attention_backend_is_validated():
    assert EngineConfig().attention_backend == "auto" and EngineConfig().use_cuda_graphs == "auto"
    # auto: our engine's graphs stay off until a GPU check has passed; vLLM's are on (on CUDA only)
    assert not EngineConfig().graphs_on("cuda") and EngineConfig().graphs_on("cuda", backend="vllm")
    forced = EngineConfig(use_cuda_graphs=True)
    assert not forced.graphs_on("cpu") and forced.graphs_on("cuda")
    with pytest.raises(ValueError, match="use_cuda_graphs"):
        EngineConfig(use_cuda_graphs="yes")
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")
    assert make_backend("auto", 4, 2, 16, torch.device("cpu")).name == "torch"


def test_a_prompt_from_position_zero_is_one_square_causal_sdpa_call(monkeypatch):
    """A whole prompt of 21 tokens in 16-token blocks: the keys are cut to the prompt (21 x 21, not 21 x 32),
    the shape CUDA's flash kernel takes with is_causal; the rows equal plain causal attention over the prompt."""
    from jobrunner.attention import torch_backend as tb

    torch.manual_seed(0)
    block_size, q_len, heads, kv_heads, dim = 16, 21, 4, 2, 8
    k_cache, v_cache = torch.randn(4 * block_size, kv_heads, dim), torch.randn(4 * block_size, kv_heads, dim)
    q = torch.randn(q_len, heads, dim)
    blocks = torch.tensor([2, 0])  # the prompt's keys: block 2 then block 0
    group = tb._chunk_group(0, q_len, q_len, blocks, block_size, torch.device("cpu"))
    calls = []
    real = F.scaled_dot_product_attention

    def spy(qg, kg, vg, **kwargs):
        calls.append((qg.shape[-2], kg.shape[-2], kwargs.get("is_causal")))
        return real(qg, kg, vg, **kwargs)

    monkeypatch.setattr(tb.F, "scaled_dot_product_attention", spy)
    out = torch.zeros(q_len, heads * dim)
    tb.attend_groups(q, k_cache, v_cache, out, [group], block_size, scale=0.3)
    assert calls == [(q_len, q_len, True)]
    keys = torch.cat([k_cache[32:48], k_cache[0:16]])[:q_len].repeat_interleave(2, dim=1).transpose(0, 1)
    values = torch.cat([v_cache[32:48], v_cache[0:16]])[:q_len].repeat_interleave(2, dim=1).transpose(0, 1)
    want = real(q.transpose(0, 1), keys, values, is_causal=True, scale=0.3).transpose(0, 1).reshape(q_len, -1)
    torch.testing.assert_close(out, want)
