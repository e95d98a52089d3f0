"""Mistral's sliding-window attention: parity with transformers on prompts and generations past the window."""

import pytest
import torch
from helpers import hf_greedy, run_checked
from tiny import CORPUS, engine_from_hf, make_hf_model

from jobrunner.engine import SamplingParams
from jobrunner.models.llama import ModelShape

WINDOW = 8
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_mistral():
    return make_hf_model("mistral", sliding_window=WINDOW)


@pytest.mark.parametrize("chunk", [512, 12])  # whole prompts, and chunked prefill (chunks starting past 0)
def test_greedy_past_the_window_matches_transformers(hf_mistral, tokenizer, chunk):
    engine = engine_from_hf(hf_mistral, tokenizer, block_size=4, max_num_batched_tokens=chunk, max_num_seqs=4)
    assert engine.runner.sliding_window == WINDOW
    prompts = [tokenizer(p)["input_ids"] for p in CORPUS[1:5]]
    assert min(len(p) for p in prompts) > 2 * WINDOW  # every prompt, and every generation, outgrows the window
    outputs = run_checked(engine, prompts, GREEDY)
    for i, ids in enumerate(prompts):
        assert outputs[f"r{i}"].output_token_ids == hf_greedy(hf_mistral, ids, 24), f"prompt {i}"


def test_prompt_logprobs_past_the_window_match_transformers(hf_mistral, tokenizer):
    engine = engine_from_hf(hf_mistral, tokenizer, block_size=4)
    ids = tokenizer(CORPUS[3])["input_ids"]
    ours = torch.tensor(engine.prompt_logprobs(ids))
    with torch.no_grad():
        logits = hf_mistral(torch.tensor([ids])).logits[0, :-1].float()
    theirs = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert torch.allclose(ours, theirs, atol=1e-4)
    full = make_hf_model("mistral", sliding_window=None)  # same seed and weights, no window
    with torch.no_grad():
        unwindowed = torch.log_softmax(full(torch.tensor([ids])).logits[0, :-1].float(), -1)
    unwindowed = unwindowed.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert torch.allclose(ours[:WINDOW - 1], unwindowed[:WINDOW - 1], atol=1e-4)  # inside the window: the same
    assert (ours[WINDOW:] - unwindowed[WINDOW:]).abs().max() > 1e-2  # past it the window changes the result


def test_window_wider_than_max_model_len_is_plain_causal(tokenizer):
    hf = make_hf_model("mistral", sliding_window=4096)
    engine = engine_from_hf(hf, tokenizer, block_size=4, max_model_len=512)
    assert engine.runner.sliding_window is None


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_per_layer_windows_are_refused(arch):
    hf = make_hf_model(arch)
    hf.config.use_sliding_window, hf.config.sliding_window = True, 8
    with pytest.raises(ValueError, match="use_sliding_window=true .* not supported"):
        ModelShape.from_config(hf.config)
    hf.config.use_sliding_window = False  # Qwen2.5's shipped configs: a window that is switched off
    assert ModelShape.from_config(hf.config).sliding_window is None
