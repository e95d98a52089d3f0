"""n samples per request: shared prompt KV blocks, one output per sample, reproducible seeded samples."""

import pytest
from helpers import run_checked
from tiny import CORPUS, engine_from_hf

from jobrunner.engine import SamplingParams


def test_prompt_is_computed_once_for_n_samples(hf_llama, tokenizer):
    prompt = CORPUS[1]
    num_prompt = len(tokenizer(prompt)["input_ids"])
    shared = engine_from_hf(hf_llama, tokenizer, block_size=4, enable_prefix_caching=False)
    outs = run_checked(shared, [prompt], SamplingParams(n=4, max_tokens=5, temperature=1.0, seed=7), by_sample=True)
    apart = engine_from_hf(hf_llama, tokenizer, block_size=4, enable_prefix_caching=False)
    run_checked(apart, [prompt] * 4, SamplingParams(max_tokens=5, temperature=1.0, seed=7), by_sample=True)
    # each sibling recomputes only the tokens after the last full shared block (here 1: 37 = 9 * 4 + 1)
    tail = num_prompt - (num_prompt - 1) // 4 * 4
    decode = 4 * 4  # 4 samples x (5 - 1) decode tokens
    assert shared.stats().num_prefill_tokens == num_prompt + 3 * tail
    assert apart.stats().num_prefill_tokens == 4 * num_prompt
    assert shared.stats().num_decode_tokens == apart.stats().num_decode_tokens == decode
    assert sorted(outs) == [("r0", i) for i in range(4)]
    assert [o.metrics.prompt_shared for o in outs.values()] == [False, True, True, True]
    assert all(o.num_samples == 4 and o.metrics.num_prompt_tokens == num_prompt for o in outs.values())
    assert outs[("r0", 1)].metrics.to_dict()["prompt_shared"] is True
    assert shared.stats().num_prompt_tokens == num_prompt  # the report counts the prompt once per row
    assert shared.stats().num_forked_samples == 3
    assert shared.stats().num_shared_prompt_tokens == 3 * (num_prompt - tail)


def test_greedy_samples_are_identical_and_seeded_ones_differ(hf_llama, tokenizer):
    engine = engine_from_hf(hf_llama, tokenizer, block_size=4, max_num_batched_tokens=32)
    greedy = run_checked(engine, [CORPUS[2]], SamplingParams(n=3, max_tokens=8, temperature=0, ignore_eos=True),
                         by_sample=True)
    assert len({tuple(o.output_token_ids) for o in greedy.values()}) == 1
    sampled = run_checked(engine, [CORPUS[2]], SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5,
                                                          ignore_eos=True), by_sample=True)
    assert len({tuple(o.output_token_ids) for o in sampled.values()}) == 3


def test_seeded_samples_are_reproducible_alone_and_batched(hf_llama, tokenizer):
    p = SamplingParams(n=3, max_tokens=10, temperature=0.9, top_k=40, seed=1234, ignore_eos=True)
    alone = run_checked(engine_from_hf(hf_llama, tokenizer), [CORPUS[1]], p, by_sample=True)
    crowd = [CORPUS[i % 5] for i in range(6)]
    params = [SamplingParams(n=2, max_tokens=7, temperature=1.0, seed=i) for i in range(6)]
    crowd[4], params[4] = CORPUS[1], p
    batched = run_checked(engine_from_hf(hf_llama, tokenizer, block_size=4, max_num_batched_tokens=48), crowd, params,
                          by_sample=True)
    for i in range(3):
        assert batched[("r4", i)].output_token_ids == alone[("r0", i)].output_token_ids


def test_n_samples_survive_preemption(hf_llama, tokenizer):
    engine = engine_from_hf(hf_llama, tokenizer, block_size=4, num_kv_blocks=40, max_num_batched_tokens=64)
    outs = run_checked(engine, CORPUS[:3], SamplingParams(n=3, max_tokens=12, temperature=0, ignore_eos=True),
                       by_sample=True)
    assert engine.stats().num_preemptions > 0
    for r in ("r0", "r1", "r2"):
        assert len({tuple(outs[(r, i)].output_token_ids) for i in range(3)}) == 1
        assert all(len(outs[(r, i)].output_token_ids) == 12 for i in range(3))


def test_a_bad_prompt_fails_every_sample(hf_llama, tokenizer):
    engine = engine_from_hf(hf_llama, tokenizer)
    outs = run_checked(engine, ["", CORPUS[0]], SamplingParams(n=2, max_tokens=3, temperature=0), by_sample=True)
    assert [outs[("r0", i)].error for i in range(2)] == ["prompt is empty"] * 2
    assert all(outs[("r1", i)].error is None for i in range(2))


@pytest.mark.parametrize("n", [0, -1, 10_000, 1.5, True])
def test_bad_n_is_named(n):
    with pytest.raises(ValueError, match="'n'"):
        SamplingParams.from_dict({"n": n})


def test_sample_keys_never_collide_with_other_ids(hf_llama, tokenizer):
    engine = engine_from_hf(hf_llama, tokenizer)
    engine.add_request("a", CORPUS[0], SamplingParams(n=2, max_tokens=3, temperature=0, ignore_eos=True))
    engine.add_request("a#1", CORPUS[1], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    lengths = sorted((o.request_id, o.sample_index, len(o.output_token_ids)) for o in outs)
    assert lengths == [("a", 0, 3), ("a", 1, 3), ("a#1", 0, 5)]
