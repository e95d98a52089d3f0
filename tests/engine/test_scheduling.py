"""Same greedy outputs whatever the batching, caching or preemption; pool integrity after every step."""

import pytest
from helpers import run_checked
from tiny import CORPUS, engine_from_hf

from jobrunner.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
SHARED = "You are a careful assistant. Answer the question step by step, and keep it short. Question: "


def _prompts():
    return [SHARED + p for p in CORPUS[:5]] + CORPUS[:3]


@pytest.fixture(scope="module")
def reference(hf_llama, tokenizer):
    engine = engine_from_hf(hf_llama, tokenizer, enable_prefix_caching=False, max_num_seqs=1)
    return {k: v.output_token_ids for k, v in run_checked(engine, _prompts(), GREEDY).items()}


@pytest.mark.parametrize("settings", [
    dict(enable_prefix_caching=True, block_size=4),
    dict(enable_prefix_caching=True, block_size=16, max_num_batched_tokens=7),
    dict(enable_prefix_caching=False, max_num_seqs=3, max_num_batched_tokens=16),
    dict(enable_prefix_caching=True, max_num_seqs=64, max_num_batched_tokens=4096),
    # the fixed-shape decode path that CUDA graphs replay, run eagerly: padding rows, scratch block, masks
    dict(enable_prefix_caching=True, block_size=4, max_num_seqs=6, static_decode=True),
    dict(enable_prefix_caching=False, max_num_seqs=64, static_decode=True),
])
def test_same_outputs_across_settings(settings, reference, hf_llama, tokenizer):
    engine = engine_from_hf(hf_llama, tokenizer, **settings)
    outputs = run_checked(engine, _prompts(), GREEDY)
    assert {k: v.output_token_ids for k, v in outputs.items()} == reference
    if settings.get("static_decode"):
        assert engine.stats().num_fixed_shape_steps > 0
        assert engine.runner.graphs.stats()["static_eager_steps"] == engine.stats().num_fixed_shape_steps


def test_prefix_cache_hits_are_counted(hf_llama, tokenizer):
    engine = engine_from_hf(hf_llama, tokenizer, block_size=4, max_num_seqs=1)
    outputs = run_checked(engine, _prompts(), GREEDY)
    shared_len = len(tokenizer(SHARED)["input_ids"])
    # requests after the first share the system prefix (whole blocks of it)
    assert outputs["r1"].metrics.num_cached_tokens >= (shared_len // 4 - 1) * 4
    assert outputs["r0"].metrics.num_cached_tokens == 0
    assert engine.stats().num_cached_tokens > 0


def test_rows_of_a_new_prefix_admitted_in_one_step_compute_it_once(reference, hf_llama, tokenizer):
    # the 5 rows sharing SHARED (uncached) enter in the same first step: the first row computes the prefix, the
    # others find its blocks (registered when allocated; the step writes KV before attending) and compute only
    # their own tails, and the greedy outputs are still those of one row at a time without caching
    engine = engine_from_hf(hf_llama, tokenizer, block_size=4, max_num_seqs=8, max_num_batched_tokens=4096)
    first_step = []
    real_schedule = engine.scheduler.schedule

    def recording_schedule():
        out = real_schedule()
        if not first_step:
            first_step.append([s.request.request_id for s in out.scheduled])
        return out

    engine.scheduler.schedule = recording_schedule
    outputs = run_checked(engine, _prompts(), GREEDY)
    assert {k: v.output_token_ids for k, v in outputs.items()} == reference
    assert first_step[0] == [f"r{i}" for i in range(8)]  # all admitted together
    shared = (len(tokenizer(SHARED)["input_ids"]) // 4 - 1) * 4  # whole blocks of the shared prefix
    assert outputs["r0"].metrics.num_cached_tokens == 0
    assert all(outputs[f"r{i}"].metrics.num_cached_tokens >= shared for i in range(1, 5))
    assert engine.stats().num_cached_tokens >= 4 * shared


def test_forced_preemption_gives_same_outputs(reference, hf_llama, tokenizer):
    # 40 blocks of 4 = 160 slots: the longest request fits alone, the batch does not, so requests are
    # preempted and recomputed
    for static_decode in (False, True):
        engine = engine_from_hf(hf_llama, tokenizer, block_size=4, num_kv_blocks=40, max_num_seqs=8,
                                static_decode=static_decode)
        outputs = run_checked(engine, _prompts(), GREEDY)
        assert {k: v.output_token_ids for k, v in outputs.items()} == reference
        assert sum(o.metrics.num_preemptions for o in outputs.values()) > 0


def test_request_longer_than_cache_is_an_error_not_a_hang(hf_llama, tokenizer):
    engine = engine_from_hf(hf_llama, tokenizer, block_size=4, num_kv_blocks=4)  # 16 slots
    long_prompt = list(range(3, 40))
    outputs = run_checked(engine, [long_prompt, [5, 6, 7]], SamplingParams(max_tokens=50, temperature=0))
    assert outputs["r0"].finish_reason == "error" and "limit is 15" in outputs["r0"].error
    # the short one runs until the whole cache is its context, then stops on length
    assert outputs["r1"].finish_reason == "length" and outputs["r1"].error is None
    assert len(outputs["r1"].output_token_ids) == 16 - 3


@pytest.mark.parametrize("max_num_batched_tokens, max_num_seqs", [(7, 64), (64, 3), (10, 2)])
def test_every_step_keeps_the_per_step_limits(max_num_batched_tokens, max_num_seqs, reference, hf_llama,
                                              tokenizer):
    engine = engine_from_hf(hf_llama, tokenizer, max_num_batched_tokens=max_num_batched_tokens,
                            max_num_seqs=max_num_seqs)
    steps = []
    real_schedule = engine.scheduler.schedule

    def recording_schedule():
        out = real_schedule()
        steps.append((out.num_tokens, len(out.scheduled)))
        return out

    engine.scheduler.schedule = recording_schedule
    outputs = run_checked(engine, _prompts(), GREEDY)
    assert {k: v.output_token_ids for k, v in outputs.items()} == reference
    assert all(tokens <= max_num_batched_tokens and rows <= max_num_seqs for tokens, rows in steps), steps
    assert any(tokens == max_num_batched_tokens for tokens, _ in steps)  # the limit binds: reached, never passed
    if max_num_seqs < len(_prompts()):
        assert any(rows == max_num_seqs for _, rows in steps)


def test_kv_cache_is_sized_from_the_memory_budget(reference, hf_llama, tokenizer):
    # 2 layers x (K, V) x 16 slots x 2 kv heads x head_dim 16 x 4 bytes (float32) = 8 KiB per block
    per_block = 2 * 2 * 16 * 2 * (64 // 4) * 4
    engine = engine_from_hf(hf_llama, tokenizer, num_kv_blocks=None, kv_cache_memory_bytes=40 * per_block + 100)
    assert engine.kv_manager.pool.num_blocks == engine.stats().kv_num_blocks == 40
    assert engine.runner.kv_cache.numel() * 4 == 40 * per_block
    outputs = run_checked(engine, _prompts(), GREEDY)  # a cache this small preempts; greedy output unchanged
    assert {k: v.output_token_ids for k, v in outputs.items()} == reference
    tiny = engine_from_hf(hf_llama, tokenizer, num_kv_blocks=None, kv_cache_memory_bytes=per_block - 1)
    assert tiny.kv_manager.pool.num_blocks == 1  # never zero blocks
