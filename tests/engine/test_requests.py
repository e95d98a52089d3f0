"""Bad input, sampling, stop conditions, logprobs and metrics on the tiny model."""

import pytest
from helpers import run_checked
from tiny import CORPUS, engine_from_hf

from jobrunner.engine import EngineConfig, SamplingParams


@pytest.fixture
def engine(hf_llama, tokenizer):
    return engine_from_hf(hf_llama, tokenizer, block_size=4, max_num_batched_tokens=64)


def test_bad_requests_fail_alone(engine):
    good = CORPUS[0]
    prompts = ["", good, "x " * 600, [], [10**9], good]
    outputs = run_checked(engine, prompts, SamplingParams(max_tokens=8, temperature=0))
    assert outputs["r0"].error == "prompt is empty" and outputs["r0"].finish_reason == "error"
    assert "tokens; the limit is" in outputs["r2"].error
    assert outputs["r3"].error == "prompt is empty"
    assert "outside the vocabulary" in outputs["r4"].error
    for ok in ("r1", "r5"):
        assert outputs[ok].error is None and len(outputs[ok].output_token_ids) == 8
    assert outputs["r1"].output_token_ids == outputs["r5"].output_token_ids


@pytest.mark.parametrize("values, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"bogus": 1}, "bogus"),
])
def test_bad_sampling_parameters_name_the_field(values, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(values)


def test_unknown_engine_setting_is_named():
    with pytest.raises(ValueError, match="max_batch"):
        EngineConfig.from_dict({"max_batch": 3})


def test_duplicate_request_id_is_refused(engine):
    engine.add_request("a", "hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("a", "hello", SamplingParams(max_tokens=2))


def test_seeded_sampling_is_independent_of_batch(hf_llama, tokenizer):
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    alone = engine_from_hf(hf_llama, tokenizer).generate([CORPUS[1]], p)[0].output_token_ids
    crowd = [CORPUS[i % 5] for i in range(7)]
    params = [SamplingParams(max_tokens=16, temperature=0.8, seed=i) for i in range(7)]
    params[3] = p
    crowd[3] = CORPUS[1]
    # a tiny KV cache forces preemption and recompute: the seeded stream must still match
    batched = engine_from_hf(hf_llama, tokenizer, block_size=4, num_kv_blocks=40).generate(crowd, params)
    assert batched[3].output_token_ids == alone
    other_seed = engine_from_hf(hf_llama, tokenizer).generate([CORPUS[1]], SamplingParams(
        max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=99))[0].output_token_ids
    assert other_seed != alone


def test_top_k_one_is_greedy(engine):
    greedy = engine.generate([CORPUS[2]], SamplingParams(max_tokens=10, temperature=0))[0]
    top1 = engine.generate([CORPUS[2]], SamplingParams(max_tokens=10, temperature=1.5, top_k=1))[0]
    assert greedy.output_token_ids == top1.output_token_ids


def test_stop_strings_across_tokens_are_removed(engine, tokenizer):
    full = engine.generate([CORPUS[0]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    text = full.text
    stop = text[5:9]  # a piece of the output that likely straddles token boundaries
    cut = engine.generate([CORPUS[0]], SamplingParams(max_tokens=20, temperature=0, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[:text.index(stop)]
    assert stop not in cut.text


def test_stop_token_ids_and_eos(engine):
    full = engine.generate([CORPUS[0]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    target = full.output_token_ids[4]
    first = full.output_token_ids.index(target)
    out = engine.generate([CORPUS[0]], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[target]))[0]
    assert out.finish_reason == "stop" and out.output_token_ids == full.output_token_ids[:first + 1]
    eng_eos = engine
    eng_eos.eos_token_ids = (target,)
    out = eng_eos.generate([CORPUS[0]], SamplingParams(max_tokens=12, temperature=0))[0]
    assert out.finish_reason == "stop" and out.output_token_ids[-1] == target


def test_logprobs_and_metrics(engine):
    out = engine.generate([CORPUS[3]], SamplingParams(max_tokens=6, temperature=0, logprobs=True,
                                                      ignore_eos=True))[0]
    assert [e.token_id for e in out.logprobs] == out.output_token_ids  # values: test_logprobs.py
    assert all(e.top_logprobs == [] for e in out.logprobs)
    m = out.metrics
    assert out.finish_reason == "length"
    assert m.num_output_tokens == 6 and m.num_prompt_tokens == len(out.prompt_token_ids)
    assert 0 <= m.queue_s <= m.ttft_s <= m.e2e_s
    assert len(m.itl_s) == 5 and m.itl_mean_s > 0
    flat = m.to_dict()
    assert set(flat) >= {"ttft_s", "itl_mean_s", "e2e_s", "queue_s", "num_cached_tokens", "num_preemptions"}
    stats = engine.stats().to_dict()
    assert stats["steps"] > 0 and stats["prefill_s"] > 0 and stats["decode_s"] > 0
    assert stats["num_output_tokens"] == 6


def test_chat_messages_use_the_template(engine, tokenizer):
    messages = [{"role": "user", "content": "Hello there"}]
    out = engine.generate([messages], SamplingParams(max_tokens=4, temperature=0))[0]
    expected = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
    assert out.prompt_token_ids == expected
