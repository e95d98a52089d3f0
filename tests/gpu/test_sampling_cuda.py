"""The sampler on CUDA: counter-based noise and draws equal to the CPU's, grammar masks and logprobs on device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))

from jobrunner.engine.sampling import filters  # noqa: E402
from jobrunner.engine.sampling.noise import gumbel, keys_tensor, row_key  # noqa: E402


def test_noise_and_draws_match_the_cpu():
    keys = [row_key(s, p) for s in (0, 7, 2**62) for p in (0, 5)]
    ids = torch.arange(50_000)[None, :]
    cpu = gumbel(keys_tensor(keys, torch.device("cpu")), ids)
    gpu = gumbel(keys_tensor(keys, torch.device("cuda")), ids.cuda())
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-6, atol=1e-6)
    logits = torch.randn(len(keys), 50_000, generator=torch.Generator().manual_seed(0)) * 4
    args = (torch.full((len(keys),), 0.8), torch.full((len(keys),), 0.9), torch.zeros(len(keys)))
    on_cpu = filters.sample_full(logits, *args, keys_tensor(keys, torch.device("cpu")))
    on_gpu = filters.sample_full(logits.cuda(), *(a.cuda() for a in args), keys_tensor(keys, torch.device("cuda")))
    assert on_gpu.cpu().tolist() == on_cpu.tolist()


def _cuda_engine():
    from tiny import make_hf_model, make_tokenizer

    from jobrunner.engine import EngineConfig, LLMEngine
    from jobrunner.models.loader import build_model, load_weights

    tokenizer, hf = make_tokenizer(), make_hf_model("llama")
    model = build_model(hf.config, torch.float32, torch.device("cuda"))
    load_weights(model, hf.state_dict().items())
    return LLMEngine(model, tokenizer, EngineConfig(device="cuda", num_kv_blocks=256),
                     eos_token_ids=[tokenizer.eos_token_id])


def test_engine_features_on_cuda():
    """n samples, logprobs, top-k, repetition penalty (device-side counts), min-p on CUDA."""
    from tiny import CORPUS

    from jobrunner.engine import SamplingParams

    engine = _cuda_engine()
    outs = engine.generate([CORPUS[0], CORPUS[1]], [
        SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=1, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.7, top_k=20, repetition_penalty=1.2, presence_penalty=0.5,
                       frequency_penalty=0.3, min_p=0.05, seed=2, ignore_eos=True)])
    for out in outs[:3]:
        assert len(out.output_token_ids) == 12
        assert all(len(e.top_logprobs) == 3 for e in out.logprobs)
    assert len(outs[3].output_token_ids) == 8


def test_structured_output_on_cuda():
    """Needs xgrammar and jsonschema, which the H200 image lacks: skipped there with that reason."""
    import json

    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (validates the output)")
    pytest.importorskip("xgrammar", reason="xgrammar is not installed (structured output's grammar engine)")
    from tiny import CORPUS

    from jobrunner.engine import SamplingParams

    engine = _cuda_engine()
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    outs = engine.generate([CORPUS[0]], [SamplingParams(n=3, max_tokens=40, temperature=1.0, seed=1,
                                                        json_schema=schema, logprobs=3)])
    for out in outs:
        jsonschema.validate(json.loads(out.text), schema)
        assert all(len(e.top_logprobs) == 3 for e in out.logprobs)
