"""End to end on Gemma 3 270M (the ``gemma3-270m`` alias: its Q4_K_M GGUF from PyPI, dequantized once into a
float32 safetensors directory): our engine's greedy tokens against transformers loading the same directory."""

import pytest
import torch

from jobrunner.engine import EngineConfig, SamplingParams
from tests.components import missing_component
from tests.prompt_sets import gsm8k_prompts

NUM_PROMPTS, NUM_TOKENS = 4, 16


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.timeout(1200)
def test_gemma3_270m_greedy_matches_transformers():
    from transformers import AutoModelForCausalLM

    from jobrunner.engine import LLMEngine
    from jobrunner.models.sources import ModelSourceError, resolve_model_dir

    try:
        model_dir = resolve_model_dir("gemma3-270m")
    except ModelSourceError as exc:  # the chunk packages are not installed (make venv installs them)
        missing_component(str(exc))
    prompts = gsm8k_prompts(NUM_PROMPTS)
    engine = LLMEngine.from_source(str(model_dir), dtype="float32",
                                   config=EngineConfig(device="cpu", max_num_seqs=8, max_num_batched_tokens=64))
    assert engine.runner.layer_windows == tuple(512 if (i + 1) % 6 else None for i in range(18))
    # Gemma 3 does not soft-cap attention logits: the CPU default backend, no silent fallback to torch
    assert engine.runner.backend.name == "cpu_paged" and "attention_notes" not in engine.runner.stats()
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    ours = engine.generate(prompts, params)  # raw prompts: the pretrained model has no chat template
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for out in ours:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert out.output_token_ids == ref, out.request_id
