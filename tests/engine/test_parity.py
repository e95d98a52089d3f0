"""Greedy float32 outputs equal transformers' own generate, token for token."""

import pytest
from helpers import hf_greedy, run_checked
from tiny import CORPUS, engine_from_hf, make_hf_model

from jobrunner.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "llama_tied", "qwen2", "qwen3", "mistral", "phi3"])
def test_greedy_matches_transformers(arch, tokenizer):
    hf = make_hf_model(arch)
    engine = engine_from_hf(hf, tokenizer, block_size=4, max_num_batched_tokens=48)
    prompts = [tokenizer(p)["input_ids"] for p in CORPUS[:6]]
    outputs = run_checked(engine, prompts, GREEDY)
    for i, ids in enumerate(prompts):
        assert outputs[f"r{i}"].output_token_ids == hf_greedy(hf, ids, 24), f"{arch} prompt {i}"


# Every scaling the loader accepts (jobrunner.models.rope.SUPPORTED_ROPE_TYPES), with original context 16 and
# prompts + generations of 40-70 positions: the scaled frequencies are used well past the original context.
ROPE_SCALINGS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0},
    # every sequence here is past 16 from its first token: the long factors throughout (a sequence crossing the
    # threshold, where transformers' Phi-3 generate recomputes, is tested in test_phi3.py)
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 16, "rope_theta": 10000.0,
                 "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 1.5 * i for i in range(8)]},
}


@pytest.mark.parametrize("rope_type", sorted(ROPE_SCALINGS))
def test_rope_scaling_matches_transformers(tokenizer, rope_type):
    import torch

    from jobrunner.models.rope import SUPPORTED_ROPE_TYPES

    assert set(ROPE_SCALINGS) == set(SUPPORTED_ROPE_TYPES)  # a newly accepted type needs its parity case here
    scaling = ROPE_SCALINGS[rope_type]
    hf = make_hf_model("llama", rope_scaling=scaling, rope_parameters=scaling, max_position_embeddings=128)
    engine = engine_from_hf(hf, tokenizer, block_size=8)
    prompts = [tokenizer(p)["input_ids"] for p in CORPUS[1:4]]
    outputs = run_checked(engine, prompts, GREEDY)
    for i, ids in enumerate(prompts):
        assert outputs[f"r{i}"].output_token_ids == hf_greedy(hf, ids, 24), f"{rope_type} prompt {i}"
    ids = prompts[0]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    theirs = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(engine.prompt_logprobs(ids)), theirs, atol=1e-4)


@pytest.mark.parametrize("rope_type", ["dynamic", "proportional", "made_up"])
def test_rope_scalings_that_change_with_length_are_refused(rope_type):
    import torch

    from jobrunner.models.loader import build_model

    scaling = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0, "original_max_position_embeddings": 16,
               "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    config = make_hf_model("llama", max_position_embeddings=128).config
    config.rope_parameters, config.rope_scaling = scaling, scaling
    with pytest.raises(ValueError, match=f"unsupported rope scaling rope_type='{rope_type}'; supported: default"):
        build_model(config, torch.float32, torch.device("cpu"))


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
