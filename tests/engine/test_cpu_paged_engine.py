"""The whole engine on the cpu_paged attention backend against the torch backend (the reference): the same greedy
tokens and logprobs within 1e-4, in float32, on a random model (blocks of 4 tokens, chunked prefill, prefix-cache
hits, preemption) and on the real embedded SmolLM2 (real prompts, a shared few-shot prefix)."""

from __future__ import annotations

import pytest
from helpers import run_checked
from tiny import CORPUS, engine_from_hf

from jobrunner.attention.cpu_paged import native_library
from jobrunner.engine import EngineConfig, SamplingParams
from tests.components import require_library
from tests.prompt_sets import gsm8k_prompts

LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(autouse=True)
def _native():
    require_library(native_library())  # a failed build fails (tests/components.py)


def _compare(torch_out: dict, native_out: dict) -> float:
    """Assert equal tokens per request; the largest logprob difference (sampled and top-k alternatives)."""
    assert sorted(torch_out) == sorted(native_out)
    worst = 0.0
    for key, ref in torch_out.items():
        got = native_out[key]
        assert got.output_token_ids == ref.output_token_ids, key
        for a, b in zip(ref.logprobs, got.logprobs, strict=True):
            worst = max(worst, abs(a.logprob - b.logprob))
            assert [t.token_id for t in a.top_logprobs] == [t.token_id for t in b.top_logprobs]
            worst = max([worst] + [abs(x.logprob - y.logprob) for x, y in zip(a.top_logprobs, b.top_logprobs)])
    return worst


def test_random_model_chunked_prefill_prefix_hits_and_preemption(hf_llama, tokenizer):
    shared = " ".join(CORPUS[:3])  # a prefix several rows share: cached blocks read in place
    prompts = [f"{shared} {c}" for c in CORPUS] + CORPUS + [shared * 2]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    outs, stats = {}, {}
    for backend in ("torch", "cpu_paged"):
        # blocks of 4 (many block boundaries), a 48-token budget (prompts cut into chunks), 40 blocks for 14 rows
        # of up to ~70 tokens (rows are preempted and recomputed)
        engine = engine_from_hf(hf_llama, tokenizer, block_size=4, max_num_batched_tokens=48, num_kv_blocks=40,
                                max_num_seqs=8, attention_backend=backend, speculative="off")
        assert engine.runner.backend.name == backend
        outs[backend] = run_checked(engine, prompts, params)
        stats[backend] = engine.stats()
    assert stats["cpu_paged"].num_preemptions == stats["torch"].num_preemptions > 0
    assert stats["cpu_paged"].num_cached_tokens == stats["torch"].num_cached_tokens > 0
    assert _compare(outs["torch"], outs["cpu_paged"]) < LOGPROB_TOLERANCE


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_smollm2_tokens_and_logprobs_match_the_torch_backend():
    from jobrunner.engine import LLMEngine

    questions = gsm8k_prompts(12)
    header = "Answer each question with a short worked solution.\n\n" + "\n".join(questions[:4]) + "\n\n"
    chats = [[{"role": "user", "content": header + q}] for q in questions[4:]] + [
        [{"role": "user", "content": q}] for q in questions[:4]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = {}
    for backend in ("torch", "cpu_paged"):
        engine = LLMEngine.from_source("smollm2-135m-instruct", dtype="float32", config=EngineConfig(
            device="cpu", max_num_seqs=16, max_num_batched_tokens=256, attention_backend=backend,
            speculative="off"))
        assert engine.runner.backend.name == backend
        outs[backend] = run_checked(engine, chats, params)
        assert engine.stats().num_cached_tokens > 0  # the shared header was read from the cache
    worst = _compare(outs["torch"], outs["cpu_paged"])
    print(f"largest logprob difference: {worst:.2e}")
    assert worst < LOGPROB_TOLERANCE


def test_auto_is_cpu_paged_for_float32_and_bf16_on_cpu_and_torch_otherwise(hf_llama, tokenizer, monkeypatch):
    import torch

    from jobrunner.attention.cpu_paged import NATIVE_ENV, _library
    from jobrunner.engine.model_runner import ModelRunner

    auto = engine_from_hf(hf_llama, tokenizer)
    assert auto.runner.stats()["attention_backend"] == "cpu_paged"
    assert auto.runner.stats()["attention_fallbacks"] == 0
    assert engine_from_hf(hf_llama, tokenizer, static_decode=True).runner.backend.name == "torch"  # fixed shapes
    config = EngineConfig(block_size=16)
    assert ModelRunner(auto.model.to(torch.bfloat16), config, 8, torch.device("cpu")).backend.name == "cpu_paged"
    assert ModelRunner(auto.model.to(torch.float16), config, 8, torch.device("cpu")).backend.name == "torch"
    assert engine_from_hf(hf_llama, tokenizer, deterministic=True).runner.backend.name == "invariant"  # as before
    monkeypatch.setenv(NATIVE_ENV, "0")  # no native kernel here: torch, and nothing counted as a failure
    _library.cache_clear()
    plain = engine_from_hf(hf_llama, tokenizer)
    assert plain.runner.stats()["attention_backend"] == "torch" and plain.runner.stats()["attention_fallbacks"] == 0
