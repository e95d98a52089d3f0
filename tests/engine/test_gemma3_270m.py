"""End to end on Gemma 3 270M (the ``gemma3-270m`` alias: its Q4_K_M GGUF from PyPI, dequantized once into a
float32 safetensors directory): our engine's greedy tokens against transformers loading the same directory."""

import json
from pathlib import Path

import pytest
import torch

from jobrunner.engine import EngineConfig, SamplingParams
from tests.components import missing_component

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k_test.prompts.jsonl"
NUM_PROMPTS, NUM_TOKENS = 4, 16


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.timeout(1200)
def test_gemma3_270m_greedy_matches_transformers():
    from transformers import AutoModelForCausalLM

    from jobrunner.engine import LLMEngine
    from jobrunner.models.sources import ModelSourceError, resolve_model_dir

    if not DATA.exists():
        missing_component(f"{DATA} not found (the shared prompt sets sit beside the checkout)")
    try:
        model_dir = resolve_model_dir("gemma3-270m")
    except ModelSourceError as exc:  # the chunk packages are not installed (make venv installs them)
        missing_component(str(exc))
    prompts = [json.loads(line)["prompt"] for line in DATA.open()][:NUM_PROMPTS]
    engine = LLMEngine.from_source(str(model_dir), dtype="float32",
                                   config=EngineConfig(device="cpu", max_num_seqs=8, max_num_batched_tokens=64))
    assert engine.runner.layer_windows == tuple(512 if (i + 1) % 6 else None for i in range(18))
    assert engine.runner.backend.name in ("cpu_paged", "torch")
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    ours = engine.generate(prompts, params)  # raw prompts: the pretrained model has no chat template
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for out in ours:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert out.output_token_ids == ref, out.request_id
