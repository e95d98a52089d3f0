"""Gemma 2 and Gemma 3 (text) against transformers: tiny random models from transformers' own config classes, a
window of 8 under prompts of 20-70 tokens (local layers between global ones), soft-capping on; greedy tokens equal
to ``generate`` and prompt logprobs within 1e-4 in float32, through chunked prefill, prefix-cache hits, preemption
and n > 1, on the torch and cpu_paged attention backends."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import hf_greedy, run_checked
from tiny import CORPUS, engine_from_hf
from transformers import AutoConfig, AutoModelForCausalLM

from jobrunner.attention.cpu_paged import native_library
from jobrunner.engine import SamplingParams
from jobrunner.models.gemma import gemma_shape
from tests.components import require_library

WINDOW = 8
LOGPROB_TOLERANCE = 1e-4
GEMMA = {
    # Gemma 2: local / global alternating (transformers' default layer_types), both soft-caps on (strong caps, so
    # that they change the result)
    "gemma2": dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], attn_logit_softcapping=3.0,
                   final_logit_softcapping=4.0),
    # Gemma 3 1B-style: local layers on their own rope base, linear x8 rope scaling on global layers only, q/k
    # norms; two local layers per global one (sliding_window_pattern=3), final soft-cap on
    "gemma3": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], sliding_window_pattern=3,
                   final_logit_softcapping=4.0,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                       "rope_theta": 1000000.0}}),
}


def make_gemma(arch: str, seed: int = 0, **overrides):
    kwargs = dict(GEMMA[arch])
    model_type = kwargs.pop("model_type")
    cfg = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, max_position_embeddings=512,
               sliding_window=WINDOW, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, **kwargs)
    cfg.update(overrides)
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # larger weights than the default init (norm weights are zeros there: 1 + w = 1)
        for p in model.parameters():
            p.normal_(0, 0.15 if p.dim() == 2 else 0.3)
    return model


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def hf_gemma(request):
    return make_gemma(request.param)


@pytest.fixture(params=["torch", "cpu_paged"])
def backend(request):
    if request.param == "cpu_paged":
        require_library(native_library())
    return request.param


def expected_backend(hf, backend: str) -> str:
    """Gemma 2 soft-caps attention logits, which the cpu_paged kernel does not: the runner takes torch."""
    return "torch" if hf.config.attn_logit_softcapping is not None and "Gemma2" in hf.config.architectures[0] \
        else backend


def _logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def test_layer_types_and_windows_come_from_the_config(hf_gemma):
    shape = gemma_shape(hf_gemma.config)
    types = hf_gemma.config.layer_types
    assert "sliding_attention" in types and "full_attention" in types
    assert shape.layer_windows == tuple(WINDOW if t == "sliding_attention" else None for t in types)
    gemma2 = shape.architecture == "Gemma2ForCausalLM"
    assert shape.attn_logit_softcapping == (3.0 if gemma2 else None) and shape.qk_norm == (not gemma2)


def test_greedy_matches_transformers_through_chunks_prefix_hits_preemption_and_n(hf_gemma, tokenizer, backend):
    shared = " ".join(CORPUS[1:3])  # a prefix several rows share: prefix-cache hits past the window
    prompts = [f"{shared} {c}" for c in CORPUS[:3]] + list(CORPUS[1:5])
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    assert min(len(p) for p in ids) > 2 * WINDOW
    # blocks of 4, a 12-token budget (every prompt in chunks starting past 0), 40 blocks for 7 rows of up to ~95
    # tokens (rows are preempted and recomputed); every row asks for 2 greedy samples (each its own sequence)
    engine = engine_from_hf(hf_gemma, tokenizer, block_size=4, max_num_batched_tokens=12, num_kv_blocks=40,
                            max_num_seqs=6, attention_backend=backend, speculative="off")
    assert engine.runner.backend.name == expected_backend(hf_gemma, backend)
    assert engine.runner.layer_windows == gemma_shape(hf_gemma.config).layer_windows
    params = SamplingParams(n=2, max_tokens=20, temperature=0, ignore_eos=True)
    outputs = run_checked(engine, ids, params, by_sample=True)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.num_cached_tokens > 0
    for i, prompt_ids in enumerate(ids):
        want = hf_greedy(hf_gemma, prompt_ids, 20)
        for sample in range(2):
            assert outputs[(f"r{i}", sample)].output_token_ids == want, f"prompt {i} sample {sample}"


def test_prompt_logprobs_match_transformers(hf_gemma, tokenizer, backend):
    engine = engine_from_hf(hf_gemma, tokenizer, block_size=4, attention_backend=backend)
    worst = 0.0
    for text in CORPUS[1:4]:
        ids = tokenizer(text)["input_ids"]
        worst = max(worst, (torch.tensor(engine.prompt_logprobs(ids)) - _logprobs(hf_gemma, ids)).abs().max().item())
    assert worst < LOGPROB_TOLERANCE
    # the engine's own logprobs of the tokens it generates (the paged path, not the scoring pass)
    ids = tokenizer(CORPUS[3])["input_ids"]
    out = run_checked(engine, [ids], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1))["r0"]
    theirs = _logprobs(hf_gemma, ids + out.output_token_ids)[len(ids) - 1:]
    ours = torch.tensor([e.logprob for e in out.logprobs])
    assert (ours - theirs).abs().max().item() < LOGPROB_TOLERANCE


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_the_window_and_the_soft_caps_change_the_result(arch, tokenizer):
    """Guards the parity tests against a window or cap that does nothing: the same weights without the window
    agree inside it and differ past it; without the caps they differ."""
    engine = engine_from_hf(make_gemma(arch), tokenizer, block_size=4)
    ids = tokenizer(CORPUS[3])["input_ids"]
    ours = torch.tensor(engine.prompt_logprobs(ids))
    unwindowed = _logprobs(make_gemma(arch, sliding_window=4096), ids)
    assert torch.allclose(ours[:WINDOW - 1], unwindowed[:WINDOW - 1], atol=1e-4)
    assert (ours[WINDOW:] - unwindowed[WINDOW:]).abs().max() > 1e-2
    uncapped = _logprobs(make_gemma(arch, attn_logit_softcapping=None, final_logit_softcapping=None), ids)
    assert (ours - uncapped).abs().max() > 1e-2


def test_gemma2_is_routed_to_torch_and_gemma3_keeps_cpu_paged(tokenizer, caplog):
    require_library(native_library())
    with caplog.at_level(logging.WARNING):
        engine = engine_from_hf(make_gemma("gemma2"), tokenizer, attention_backend="cpu_paged")
    assert engine.runner.backend.name == "torch"
    (note,) = engine.runner.stats()["attention_notes"]
    assert "soft-caps attention logits (attn_logit_softcapping=3)" in note and note in caplog.text
    engine = engine_from_hf(make_gemma("gemma3"), tokenizer, attention_backend="auto")
    assert engine.runner.backend.name == "cpu_paged" and "attention_notes" not in engine.runner.stats()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_windows_turn_triton_and_decode_graphs_off_and_say_so(arch, tokenizer):
    hf = make_gemma(arch)
    num_local = hf.config.layer_types.count("sliding_attention")
    engine = engine_from_hf(hf, tokenizer, block_size=4, static_decode=True)
    assert engine.runner.graphs is None
    notes = engine.runner.stats()["attention_notes"]  # Gemma 2 also: soft-capping takes torch, not cpu_paged
    assert any(f"window 8 on {num_local} of 6 layers < max_model_len 512" in note and "decode_graphs='static'" in note
               for note in notes)


def test_windows_wider_than_max_model_len_keep_the_decode_graphs_and_soft_cap_there(tokenizer):
    """No sequence outgrows a window of 64 under max_model_len 64: one (full) window for every layer, the decode
    graphs' fixed-shape path (its eager twin here) runs, and attention is still soft-capped (Gemma 2)."""
    hf = make_gemma("gemma2", sliding_window=64)
    engine = engine_from_hf(hf, tokenizer, block_size=4, max_model_len=64, static_decode=True)
    assert engine.runner.layer_windows is None and engine.runner.sliding_window is None
    assert engine.runner.graphs is not None
    ids = [tokenizer(p)["input_ids"] for p in CORPUS[1:4]]
    outputs = run_checked(engine, ids, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert engine.runner.stats()["static_eager_steps"] > 0
    for i, prompt_ids in enumerate(ids):
        assert outputs[f"r{i}"].output_token_ids == hf_greedy(hf, prompt_ids, 16), f"prompt {i}"


def test_bidirectional_gemma3_is_refused():
    config = make_gemma("gemma3").config
    config.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="use_bidirectional_attention=true is not supported"):
        gemma_shape(config)


def test_weights_load_by_checkpoint_names_with_tied_head(tokenizer):
    hf = make_gemma("gemma3")
    names = set(hf.state_dict())
    assert {"model.layers.0.pre_feedforward_layernorm.weight", "model.layers.0.self_attn.q_norm.weight",
            "model.layers.0.post_feedforward_layernorm.weight"} <= names
    engine = engine_from_hf(hf, tokenizer)
    assert engine.model.lm_head.weight is engine.model.embed_tokens.weight


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_deterministic_mode_keeps_windows_and_soft_caps(arch, tokenizer):
    """The invariant backend (deterministic mode on CPU) takes per-layer windows and soft-capping too."""
    hf = make_gemma(arch)
    engine = engine_from_hf(hf, tokenizer, block_size=4, max_num_batched_tokens=12, deterministic=True)
    assert engine.runner.backend.name == "invariant"
    ids = [tokenizer(p)["input_ids"] for p in CORPUS[1:3]]
    outputs = run_checked(engine, ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for i, prompt_ids in enumerate(ids):
        assert outputs[f"r{i}"].output_token_ids == hf_greedy(hf, prompt_ids, 12), f"prompt {i}"
