"""Quantized models inside our engine: tiny random Llama-family models, every architecture flavour."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))

from tiny import make_hf_model, make_tokenizer  # noqa: E402

from jobrunner.engine import EngineConfig, SamplingParams  # noqa: E402
from jobrunner.engine.llm_engine import LLMEngine  # noqa: E402
from jobrunner.models.loader import build_model, load_weights  # noqa: E402
from jobrunner.quant import quantize_model  # noqa: E402
from jobrunner.quant.measure import agreement, perplexity  # noqa: E402

PROMPTS = ["The quick brown fox", "Natalia sold clips to", "Hello there", "Write a persuasive email"]


def _engine(hf_model, tokenizer, scheme: str) -> LLMEngine:
    model = build_model(hf_model.config, torch.float32, torch.device("cpu"))
    load_weights(model, hf_model.state_dict().items())
    report = quantize_model(model, scheme)
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64, enable_prefix_caching=False),
                       eos_token_ids=[tokenizer.eos_token_id])
    engine.model_info["quantization_report"] = report.summary()
    return engine


@pytest.mark.parametrize("arch", ["llama_tied", "qwen2", "qwen3", "mistral"])  # tied; qkv bias; q/k norm; untied
def test_engine_runs_quantized_and_tracks_float(arch: str) -> None:
    tokenizer = make_tokenizer()
    hf_model = make_hf_model(arch)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens, ppl = {}, {}
    for scheme in ("none", "int8", "int4"):
        engine = _engine(hf_model, tokenizer, scheme)
        outputs = engine.generate(PROMPTS, params)
        assert all(o.finish_reason == "length" and len(o.output_token_ids) == 8 for o in outputs)
        tokens[scheme] = [list(o.output_token_ids) for o in outputs]
        ppl[scheme] = perplexity(engine.model, tokenizer, PROMPTS)
    # Random tiny models have near-tied logits (median top-2 margin ~0.2), so later tokens may drift.
    first = [[row[0]] for row in tokens["none"]], [[row[0]] for row in tokens["int8"]]
    assert agreement(*first)["exact"] >= 0.75
    assert ppl["int8"] < ppl["none"] * 1.05 and ppl["int4"] < ppl["none"] * 1.5


def test_measure_quantization_side_by_side() -> None:
    from jobrunner.quant.measure import measure_quantization, to_markdown

    tokenizer = make_tokenizer()
    hf_model = make_hf_model("llama_tied")
    result = measure_quantization(lambda scheme: _engine(hf_model, tokenizer, scheme), tokenizer,
                                  texts=PROMPTS, prompts=PROMPTS[:3], schemes=("none", "int8", "int4", "fp8"),
                                  batch_sizes=(1, 2), max_tokens=4)
    rows = result["schemes"]
    assert rows["none"]["greedy_agreement"]["exact"] == 1.0 and rows["none"]["perplexity_vs_base"] == 1.0
    assert rows["none"]["teacher_forced_top1_agreement"] == 1.0
    decisions = rows["none"]["greedy_decision_agreement"]  # the reference re-reading its own tokens
    assert decisions["agreement"] == 1.0 and decisions["num_tokens"] == 3 * 4 and decisions["num_different"] == 0
    assert 0.5 <= rows["int8"]["greedy_decision_agreement"]["agreement"] <= 1.0
    assert 0.5 < rows["int8"]["teacher_forced_top1_agreement"] <= 1.0
    assert rows["int4"]["linear_weight_bytes"] < rows["int8"]["linear_weight_bytes"]
    assert rows["int8"]["linear_bytes_vs_base"] < 0.3  # float32 engine: int8 is ~1/4 of its bytes
    assert set(rows["int4"]["throughput"]) == {"1", "2"}
    assert rows["int8"]["quantization_report"]["scheme"] == "int8"
    assert rows["fp8"]["linear_weight_bytes"] == rows["int8"]["linear_weight_bytes"]  # 1 byte + f32 row scale
    assert rows["fp8"]["perplexity_vs_base"] < 1.05 and rows["fp8"]["quantization_report"]["scheme"] == "fp8"
    table = to_markdown(result)
    assert "greedy decisions" in table
    assert table.count("\n") == 5 and "| int4 |" in table and "| fp8 |" in table


def test_decision_agreement_counts_and_gaps() -> None:
    from jobrunner.quant.measure import decision_agreement

    reference = [[1, 2, 3], [4, 5]]
    choices = [[1, 9, 3], [4, 5]]
    gaps = [[2.0, 0.1, 1.0], [3.0, 0.5]]
    out = decision_agreement(reference, choices, gaps)
    assert out["agreement"] == 4 / 5 and out["num_different"] == 1 and out["num_tokens"] == 5
    assert out["gap_at_differences_median"] == out["gap_at_differences_max"] == 0.1
    assert out["gap_median_all"] == 1.0
