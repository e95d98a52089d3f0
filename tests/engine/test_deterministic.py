"""engine.deterministic: the same rows (tokens and logprob bits) whatever the batching, chunking, cache or preemption.

Tiny random-weight model, bfloat16 and float32. Seeded sampled rows (top-p, top-k) and greedy rows, all with
the sampled token's logprob: the logprob's float bits expose any difference in the logits, even one that does
not flip a token. The default mode's bits do change across these configurations (float32 below; on this tiny
model bfloat16 rounding hides them, the real SmolLM2 shows them:
scripts/deterministic_bench.py at commit a75bf8c, a one-off).
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_checked
from tiny import CORPUS, make_hf_model

from jobrunner.engine import EngineConfig, SamplingParams
from jobrunner.engine.invariant import RowTiled
from jobrunner.engine.llm_engine import LLMEngine
from jobrunner.models.loader import build_model, load_weights

PREFIX = " ".join(CORPUS[:3])  # a shared prefix over several KV blocks: prefix-cache hits
PROMPTS = [PREFIX + " " + CORPUS[i % 6] * (1 + i % 2) for i in range(6)]
PARAMS = [
    SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, logprobs=0) if i % 3 == 0 else
    SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=100 + i, logprobs=0,
                   top_p=0.9 if i % 2 else 1.0, top_k=16 if i % 3 == 2 else 0)
    for i in range(6)
]
CONFIGS = {
    "max_num_seqs=1": dict(max_num_seqs=1),
    "max_num_seqs=2, chunked prefill": dict(max_num_seqs=2, max_num_batched_tokens=24),
    "preemption": dict(max_num_seqs=64, num_kv_blocks=20, max_num_batched_tokens=40),
    "prefix-cache hit": dict(max_num_seqs=64),
}


def _engine(hf_model, tokenizer, dtype: torch.dtype, **config) -> LLMEngine:
    model = build_model(hf_model.config, dtype, torch.device("cpu"))
    load_weights(model, hf_model.state_dict().items())
    config.setdefault("num_kv_blocks", 256)
    return LLMEngine(model, tokenizer, EngineConfig(**config), eos_token_ids=[tokenizer.eos_token_id])


def _rows(hf_model, tokenizer, dtype, deterministic: bool, name: str = "", **config):
    engine = _engine(hf_model, tokenizer, dtype, deterministic=deterministic, **config)
    if name == "prefix-cache hit":  # warm the cache with the shared prefix (seeded: no engine seeds drawn)
        run_checked(engine, PROMPTS[:2], SamplingParams(max_tokens=2, seed=1))
    outs = run_checked(engine, PROMPTS, PARAMS)
    rows = [(outs[f"r{i}"].output_token_ids, [lp.logprob for lp in outs[f"r{i}"].logprobs])
            for i in range(len(PROMPTS))]
    return rows, engine.stats()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_deterministic_rows_identical_across_configurations(hf_llama, tokenizer, dtype):
    base, _ = _rows(hf_llama, tokenizer, dtype, True)
    for name, config in CONFIGS.items():
        rows, stats = _rows(hf_llama, tokenizer, dtype, True, name, **config)
        assert rows == base, f"{name}: rows differ from max_num_seqs=64"
        if name == "preemption":
            assert stats.num_preemptions > 0
        if name == "prefix-cache hit":
            assert stats.num_cached_tokens > 0


def test_default_mode_changes_bits_where_deterministic_does_not(hf_llama, tokenizer):
    # the test's teeth: without deterministic mode the same configurations give other logit bits
    base, _ = _rows(hf_llama, tokenizer, torch.float32, False)
    changed = next((name for name, config in CONFIGS.items()  # stops at the first configuration that differs
                    if _rows(hf_llama, tokenizer, torch.float32, False, name, **config)[0] != base), None)
    assert changed, "the default mode was batch-invariant on every configuration: the test above has no teeth"


def test_deterministic_tokens_match_default_in_float32(hf_llama, tokenizer):
    # the fixed-order attention and tiled layers compute the same model (bits aside)
    det, _ = _rows(hf_llama, tokenizer, torch.float32, True)
    default, _ = _rows(hf_llama, tokenizer, torch.float32, False)
    assert [r[0] for r in det] == [r[0] for r in default]
    for (_, a), (_, b) in zip(det, default):
        assert a == pytest.approx(b, abs=1e-4)


def test_deterministic_wraps_row_wise_layers_once_and_records_it(hf_llama, tokenizer):
    engine = _engine(hf_llama, tokenizer, torch.float32, deterministic=True)
    layer = engine.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, RowTiled) and isinstance(layer.mlp, RowTiled)
    assert engine.model.lm_head.weight is engine.model.lm_head.inner.weight
    assert engine.runner.backend.name == "invariant" and engine.runner.sampler.invariant
    assert engine.model_info["deterministic"] is True
    again = LLMEngine(engine.model, tokenizer, engine.config, eos_token_ids=[2])  # a worker's rebuild
    assert not isinstance(again.model.layers[0].mlp.inner, RowTiled)


def test_row_tiled_matches_untiled_rows():
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 5)
    x = torch.randn(70, 8)
    with torch.no_grad():
        assert torch.allclose(RowTiled(linear, 32)(x), linear(x))
        assert RowTiled(linear, 32)(x[:1]).shape == (1, 5)


def test_spec_passes_deterministic_to_the_engine_config():
    from jobrunner.driver.engine_factory import engine_config_kwargs
    from jobrunner.spec import JobSpec

    spec = JobSpec.model_validate({"name": "d", "input": {"url": "in.parquet", "prompt_column": "prompt"},
                                   "output": {"url": "out"}, "engine": {"deterministic": True}})
    assert EngineConfig(**engine_config_kwargs(spec)).deterministic is True
    assert spec.redacted()["engine"]["deterministic"] is True  # the manifest's copy of the spec records it


def test_deterministic_int8_rows_identical(hf_llama, tokenizer):
    # quantized linears pick their kernel by row count; fixed row tiles make them invariant too
    from jobrunner.quant import quantize_model

    def rows(**config):
        model = build_model(hf_llama.config, torch.float32, torch.device("cpu"))
        load_weights(model, hf_llama.state_dict().items())
        quantize_model(model, "int8")
        engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=256, deterministic=True, **config),
                           eos_token_ids=[tokenizer.eos_token_id])
        outs = run_checked(engine, PROMPTS[:4], PARAMS[:4])
        return [(o.output_token_ids, [lp.logprob for lp in o.logprobs]) for _, o in sorted(outs.items())]

    assert rows(max_num_seqs=64) == rows(max_num_seqs=1, max_num_batched_tokens=24)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_speculation_in_deterministic_mode_changes_no_bit(tokenizer, dtype):
    # a verification step scores a row's 1 + k positions like a prompt chunk, which the fixed tiles and the
    # fixed-order attention already make invariant: with or without drafts, at any batch, the same bits
    hf = make_hf_model(vocab_size=12)  # a random model over 12 tokens loops: n-gram drafts get accepted
    prompts = [[(i * 7 + j) % 9 + 3 for i in range(12)] * 2 for j in range(4)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, logprobs=0, temperature=0.0 if j % 2 else 0.9,
                             seed=7 + j, top_k=6 if j == 2 else 0) for j in range(4)]

    def rows(speculative: str, **config):
        engine = _engine(hf, tokenizer, dtype, deterministic=True, speculative=speculative, **config)
        outs = run_checked(engine, prompts, params)
        return [(o.output_token_ids, [lp.logprob for lp in o.logprobs]) for _, o in sorted(outs.items())], engine

    base, _ = rows("off")
    for speculative, config in (("ngram", {}), ("ngram", dict(max_num_seqs=1)),
                                ("ngram", dict(max_num_seqs=2, max_num_batched_tokens=24)), ("auto", {})):
        got, engine = rows(speculative, **config)
        assert got == base, f"{speculative} {config}: rows differ from speculation off"
        if speculative == "ngram":
            assert engine.stats().num_accepted_tokens > 0
