"""Top-K logprobs of output and prompt tokens against transformers' log-softmax on the tiny Llama."""

import pytest
import torch
from tiny import CORPUS, engine_from_hf

from jobrunner.engine import SamplingParams


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """``[T, V]`` log-softmax of transformers' logits: row i is the distribution of token i + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_entry(entry, expected_row: torch.Tensor, k: int, tokenizer) -> None:
    assert entry.logprob == pytest.approx(expected_row[entry.token_id].item(), abs=1e-4)
    assert entry.token == tokenizer.decode([entry.token_id])
    top_values, top_ids = expected_row.topk(k)
    assert [t.token_id for t in entry.top_logprobs] == top_ids.tolist()
    assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top_values.tolist(), abs=1e-4)
    assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([i]) for i in top_ids.tolist()]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_output_top_logprobs_match_transformers(hf_llama, tokenizer, temperature):
    engine = engine_from_hf(hf_llama, tokenizer, block_size=4)
    params = SamplingParams(max_tokens=6, temperature=temperature, seed=3, logprobs=5, ignore_eos=True,
                            repetition_penalty=1.3)  # processors do not change the reported distribution
    out = engine.generate([CORPUS[1]], params)[0]
    expected = hf_logprobs(hf_llama, out.prompt_token_ids + out.output_token_ids)
    start = len(out.prompt_token_ids) - 1
    assert [e.token_id for e in out.logprobs] == out.output_token_ids
    for i, entry in enumerate(out.logprobs):
        check_entry(entry, expected[start + i], 5, tokenizer)


def test_prompt_logprobs_match_transformers(hf_llama, tokenizer):
    engine = engine_from_hf(hf_llama, tokenizer)
    outs = engine.generate([CORPUS[0]], SamplingParams(max_tokens=2, temperature=0, n=2, prompt_logprobs=3))
    prompt = outs[0].prompt_token_ids
    expected = hf_logprobs(hf_llama, prompt)
    entries = outs[0].prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    assert [e.token_id for e in entries[1:]] == prompt[1:]
    for i, entry in enumerate(entries[1:]):
        check_entry(entry, expected[i], 3, tokenizer)
    assert outs[1].prompt_logprobs == entries  # computed once, shared by the samples
    assert outs[0].logprobs is None


def test_mixed_k_in_one_batch(hf_llama, tokenizer):
    engine = engine_from_hf(hf_llama, tokenizer)
    ks = [None, 0, 2, 20]
    outs = engine.generate([CORPUS[2]] * 4, [SamplingParams(max_tokens=3, temperature=0, logprobs=k) for k in ks])
    assert outs[0].logprobs is None
    for k, out in zip(ks[1:], outs[1:]):
        assert len(out.logprobs) == 3 and all(len(e.top_logprobs) == k for e in out.logprobs)
    assert outs[1].logprobs[0].logprob == outs[3].logprobs[0].logprob


@pytest.mark.parametrize("value", [-1, 21, 2.5, "5"])
def test_bad_logprobs_is_named(value):
    with pytest.raises(ValueError, match="'logprobs'"):
        SamplingParams(logprobs=value)
    with pytest.raises(ValueError, match="'prompt_logprobs'"):
        SamplingParams(prompt_logprobs=value)


def test_boolean_logprobs_still_accepted():
    assert SamplingParams(logprobs=True).logprobs == 0
    assert SamplingParams(logprobs=False).logprobs is None
