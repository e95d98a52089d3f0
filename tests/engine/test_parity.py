"""Greedy float32 outputs equal transformers' own generate, token for token."""

import pytest
from helpers import hf_greedy, run_checked
from tiny import CORPUS, engine_from_hf, make_hf_model

from jobrunner.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "llama_tied", "qwen2", "qwen3", "mistral"])
def test_greedy_matches_transformers(arch, tokenizer):
    hf = make_hf_model(arch)
    engine = engine_from_hf(hf, tokenizer, block_size=4, max_num_batched_tokens=48)
    prompts = [tokenizer(p)["input_ids"] for p in CORPUS[:6]]
    outputs = run_checked(engine, prompts, GREEDY)
    for i, ids in enumerate(prompts):
        assert outputs[f"r{i}"].output_token_ids == hf_greedy(hf, ids, 24), f"{arch} prompt {i}"


def test_rope_scaling_llama3_matches_transformers(tokenizer):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    hf = make_hf_model("llama", rope_scaling=scaling, rope_parameters=scaling)
    engine = engine_from_hf(hf, tokenizer, block_size=8)
    prompts = [tokenizer(p)["input_ids"] for p in CORPUS[:3]]
    outputs = run_checked(engine, prompts, GREEDY)
    for i, ids in enumerate(prompts):
        assert outputs[f"r{i}"].output_token_ids == hf_greedy(hf, ids, 24)


def test_prompt_logprobs_match_transformers(hf_llama, tokenizer):
    import torch

    engine = engine_from_hf(hf_llama, tokenizer)
    ids = tokenizer(CORPUS[0])["input_ids"]
    ours = engine.prompt_logprobs(ids)
    with torch.no_grad():
        logits = hf_llama(torch.tensor([ids])).logits[0, :-1].float()
    theirs = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert len(ours) == len(ids) - 1
    assert torch.allclose(torch.tensor(ours), theirs, atol=1e-4)
    assert engine.kv_manager.pool.num_used_blocks == 0
