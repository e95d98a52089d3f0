"""Phi-3 / Phi-3.5 (Phi3ForCausalLM): token-for-token parity with transformers' generate, longrope included.

The longrope model has original_max_position_embeddings 32 (the threshold) and factor lists of head_dim / 2:
prompts of 22 and 32 tokens start on the short table and cross the threshold while generating (transformers drops
its cache there and recomputes on the long table; so do we, engine/long_rope.py), prompts of 33 and 37 tokens
run on the long table from their first token.
"""

import pytest
import torch
from helpers import hf_greedy, run_checked
from tiny import CORPUS, engine_from_hf, make_hf_model

from jobrunner.engine import SamplingParams
from jobrunner.engine.long_rope import make_long_rope_switch
from jobrunner.models.loader import build_model, load_weights
from jobrunner.models.rope import RotaryEmbedding, rope_parameters

THRESHOLD = 32
HEAD_DIM = 16  # hidden 64 / 4 heads: factor lists of 8
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
            "long_factor": [1.0 + 1.5 * i for i in range(HEAD_DIM // 2)]}
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def make_phi3(rope=None, **overrides):
    rope = dict(rope or {"rope_type": "default", "rope_theta": 10000.0})
    return make_hf_model("phi3", max_position_embeddings=128, original_max_position_embeddings=THRESHOLD,
                         rope_parameters=rope, **overrides)


@pytest.fixture(scope="module")
def hf_longrope():
    return make_phi3(LONGROPE)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    ids = [tokenizer(p)["input_ids"] for p in CORPUS[:3]]
    out = [ids[0], ids[1][:THRESHOLD], ids[1], ids[2]]
    assert [len(p) for p in out] == [22, 32, 37, 33]
    return out


@pytest.fixture(scope="module")
def expected(hf_longrope, prompts):
    """transformers' greedy tokens for each prompt (its generate recomputes at the threshold)."""
    return [hf_greedy(hf_longrope, ids, MAX_TOKENS) for ids in prompts]


def _check(outputs, expected, keys=None):
    for i, want in enumerate(expected):
        key = f"r{i}" if keys is None else keys(i)
        assert outputs[key].output_token_ids == want, f"prompt {i}"


@pytest.mark.parametrize("chunk", [512, 12])  # whole prompts, and chunked prefill (long prompts in 3-4 chunks)
def test_longrope_greedy_matches_transformers(hf_longrope, tokenizer, prompts, expected, chunk):
    engine = engine_from_hf(hf_longrope, tokenizer, block_size=4, max_num_batched_tokens=chunk, max_num_seqs=4)
    assert engine.scheduler.long_rope.threshold == THRESHOLD
    _check(run_checked(engine, prompts, GREEDY), expected)
    # the two short prompts were computed again on the long table when they crossed the threshold
    assert engine.stats().num_prefill_tokens > sum(len(p) for p in prompts)


def test_without_the_switch_the_tokens_differ(hf_longrope, tokenizer, prompts, expected):
    """The parity above is not vacuous: short-table keys past the threshold change the tokens."""
    engine = engine_from_hf(hf_longrope, tokenizer, block_size=4)
    engine.scheduler.long_rope = None  # every request stays on the short table
    outputs = run_checked(engine, prompts, GREEDY)
    assert sum(outputs[f"r{i}"].output_token_ids != want for i, want in enumerate(expected)) >= 2


def test_longrope_prefix_cache_reuse_and_table_isolation(hf_longrope, tokenizer, prompts, expected):
    engine = engine_from_hf(hf_longrope, tokenizer, block_size=4)
    short = run_checked(engine, [prompts[1]], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    assert short["r0"].output_token_ids == expected[1][:1]  # 33 tokens, finished before any recompute
    # the same 32 tokens (and 5 more) on the long table: the short blocks must not be found
    long = run_checked(engine, [prompts[2]], GREEDY)
    assert long["r0"].metrics.num_cached_tokens == 0
    assert long["r0"].output_token_ids == expected[2]
    again = run_checked(engine, [prompts[1]], GREEDY)  # its short blocks are found; after crossing, long ones
    assert again["r0"].metrics.num_cached_tokens == 28
    assert again["r0"].output_token_ids == expected[1]
    _check(run_checked(engine, prompts, GREEDY), expected)
    second = run_checked(engine, prompts, GREEDY)  # everything again: hits on both tables
    assert all(second[f"r{i}"].metrics.num_cached_tokens > 0 for i in range(len(prompts)))
    _check(second, expected)


def test_longrope_under_preemption(hf_longrope, tokenizer, prompts, expected):
    engine = engine_from_hf(hf_longrope, tokenizer, block_size=4, num_kv_blocks=30, max_num_seqs=4)
    outputs = run_checked(engine, prompts, GREEDY)
    assert sum(o.metrics.num_preemptions for o in outputs.values()) > 0
    _check(outputs, expected)


def test_longrope_n_samples(hf_longrope, tokenizer, prompts, expected):
    engine = engine_from_hf(hf_longrope, tokenizer, block_size=4, max_num_batched_tokens=32)
    params = SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outputs = run_checked(engine, [prompts[0], prompts[2]], params, by_sample=True)
    for i, want in enumerate([expected[0], expected[2]]):
        assert [outputs[(f"r{i}", s)].output_token_ids for s in range(2)] == [want, want], f"prompt {i}"


def test_longrope_on_the_fixed_shape_decode_path(hf_longrope, tokenizer, prompts, expected):
    """Decode graphs' eager twin: rows on the long table read their rope rows, and attend by their length."""
    engine = engine_from_hf(hf_longrope, tokenizer, block_size=4, static_decode=True, max_num_seqs=4)
    _check(run_checked(engine, prompts, GREEDY), expected)
    assert engine.stats().num_fixed_shape_steps > 0


def test_long_rope_switch_rules():
    from jobrunner.engine.long_rope import LongRopeSwitch
    from jobrunner.engine.request import Request

    switch = LongRopeSwitch(THRESHOLD)
    request = Request("a", list(range(THRESHOLD - 3)), GREEDY, 0.0)
    request.num_computed_tokens, request.block_hashes = THRESHOLD - 3, [1, 2]
    assert switch.table_for(request) == 0 and not switch.must_recompute(request)
    assert switch.max_draft(request) == 3  # the drafts' logits come from sequences of 30..32 tokens: short
    request.output_token_ids = [5, 5, 5, 5]  # 33 tokens: past the threshold
    assert switch.must_recompute(request) and switch.max_draft(request) == 0
    request.num_computed_tokens = 0
    switch.assign(request)
    assert request.rope_table == 1 and request.block_hashes == [] and switch.max_draft(request) is None


def test_longrope_with_ngram_drafts(hf_longrope, tokenizer, prompts, expected):
    engine = engine_from_hf(hf_longrope, tokenizer, block_size=4, speculative="ngram")
    _check(run_checked(engine, prompts, GREEDY), expected)


@pytest.mark.parametrize("index", [0, 2])  # 22 tokens (short table), 37 tokens (long table)
def test_longrope_prompt_logprobs_match_transformers(hf_longrope, tokenizer, prompts, index):
    ids = prompts[index]
    engine = engine_from_hf(hf_longrope, tokenizer, block_size=4)
    ours = torch.tensor(engine.prompt_logprobs(ids))
    with torch.no_grad():
        logits = hf_longrope(torch.tensor([ids])).logits[0, :-1].float()
    theirs = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert (ours - theirs).abs().max() < 1e-4


def test_switch_only_when_the_engine_can_pass_the_threshold(hf_longrope, tokenizer, prompts):
    engine = engine_from_hf(hf_longrope, tokenizer, block_size=4, max_model_len=THRESHOLD)
    assert engine.scheduler.long_rope is None  # every reachable length is on the short table, as transformers
    out = run_checked(engine, [prompts[0]], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
    assert out["r0"].output_token_ids == hf_greedy(hf_longrope, prompts[0], 9)
    small = build_model(hf_longrope.config, torch.float32, torch.device("cpu"), max_positions=THRESHOLD)
    assert small.rotary.long_threshold is None and small.rotary.cos.shape[0] == THRESHOLD  # no long table built
    assert make_long_rope_switch(small, 4096) is None


def test_longrope_tables_follow_transformers(hf_longrope):
    ours = RotaryEmbedding(hf_longrope.config, HEAD_DIM, 128)
    theirs = hf_longrope.model.rotary_emb
    x = torch.zeros(1, dtype=torch.float32)
    for seq_len, offset in [(THRESHOLD, 0), (THRESHOLD + 1, 128)]:
        pos = torch.arange(seq_len)[None]
        cos, sin = theirs(x, pos)
        assert torch.allclose(ours.cos[pos[0] + offset], cos[0], atol=1e-6)
        assert torch.allclose(ours.sin[pos[0] + offset], sin[0], atol=1e-6)
    assert ours.scaling == pytest.approx((1 + torch.log(torch.tensor(4.0)) / torch.log(torch.tensor(32.0))) ** 0.5)


@pytest.mark.parametrize("name", ["su", "yarn"])
def test_older_longrope_names(name):
    # transformers 5.24 renames the type after standardizing, so only a legacy dict that carries
    # original_max_position_embeddings itself loads there (a top-level one alone raises a KeyError in transformers)
    legacy = {**LONGROPE, "type": name, "original_max_position_embeddings": THRESHOLD}
    del legacy["rope_type"]
    hf = make_hf_model("phi3", max_position_embeddings=128, original_max_position_embeddings=THRESHOLD,
                       rope_scaling=legacy)
    assert rope_parameters(hf.config)["rope_type"] == "longrope"
    assert RotaryEmbedding(hf.config, HEAD_DIM, 128).long_threshold == THRESHOLD

    class OldConfig:  # a config object that kept the old name (transformers' Phi3Config renames it itself)
        model_type, rope_scaling, rope_theta = "phi3", legacy, 10000.0

    assert rope_parameters(OldConfig())["rope_type"] == "longrope"


@pytest.mark.parametrize("chunk", [512, 12])
def test_sliding_window_matches_transformers(tokenizer, prompts, chunk):
    hf = make_phi3(sliding_window=8)  # Phi-3-mini-4k's 2047, scaled down: every prompt outgrows it
    engine = engine_from_hf(hf, tokenizer, block_size=4, max_num_batched_tokens=chunk, max_num_seqs=4)
    assert engine.runner.sliding_window == 8
    _check(run_checked(engine, prompts, GREEDY), [hf_greedy(hf, ids, MAX_TOKENS) for ids in prompts])


def test_fused_checkpoint_tensors_are_required(tokenizer):
    hf = make_phi3()
    model = build_model(hf.config, torch.float32, torch.device("cpu"))
    state = {k: v for k, v in hf.state_dict().items() if k != "model.layers.1.self_attn.qkv_proj.weight"}
    with pytest.raises(ValueError, match=r"missing 3 weight\(s\), e.g. layers.1.self_attn.qkv_proj.weight#0"):
        load_weights(model, state.items())


def test_unsupported_phi3_variants_are_refused():
    partial = make_phi3(partial_rotary_factor=0.75)  # Phi-4-mini's (a Phi3ForCausalLM)
    with pytest.raises(ValueError, match="partial_rotary_factor=0.75"):
        build_model(partial.config, torch.float32, torch.device("cpu"))
    gelu = make_phi3()
    gelu.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported"):
        build_model(gelu.config, torch.float32, torch.device("cpu"))


def test_longrope_decode_logprobs_match_uncached_transformers(hf_longrope, tokenizer, prompts, expected):
    """Each generated token's logprob equals transformers' uncached forward over the sequence so far (short table
    up to the threshold, long past it), through chunked prefill, paged decode and the recompute."""
    engine = engine_from_hf(hf_longrope, tokenizer, block_size=4, max_num_batched_tokens=12)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    outputs = run_checked(engine, [prompts[0], prompts[2]], params)
    for i, index in enumerate([0, 2]):
        out = outputs[f"r{i}"]
        assert out.output_token_ids == expected[index]
        sequence = prompts[index] + out.output_token_ids
        with torch.no_grad():
            theirs = [torch.log_softmax(hf_longrope(torch.tensor([sequence[:n]])).logits[0, -1].float(), -1)[tok]
                      for n, tok in zip(range(len(prompts[index]), len(sequence)), out.output_token_ids)]
        diff = (torch.tensor([e.logprob for e in out.logprobs]) - torch.stack(theirs)).abs().max()
        assert diff < 1e-4, f"prompt {index}: {diff}"


def test_saved_longrope_checkpoint_loads_and_matches(hf_longrope, tokenizer, prompts, expected, tmp_path):
    """Through the real loader: config.json round trip (longrope, top-level original_max_position_embeddings),
    safetensors with the fused tensors; max_model_len past the threshold keeps the switch, one within it drops it."""
    from jobrunner.engine import EngineConfig
    from jobrunner.engine.llm_engine import LLMEngine

    hf_longrope.save_pretrained(str(tmp_path))
    tokenizer.save_pretrained(str(tmp_path))
    config = EngineConfig(device="cpu", block_size=4, num_kv_blocks=256, max_model_len=96)
    engine = LLMEngine.from_source(str(tmp_path), dtype="float32", config=config)
    assert engine.model_info["architecture"] == "Phi3ForCausalLM"
    assert engine.scheduler.long_rope.threshold == THRESHOLD
    _check(run_checked(engine, prompts, GREEDY), expected)
    short = LLMEngine.from_source(str(tmp_path), dtype="float32",
                                  config=EngineConfig(device="cpu", block_size=4, num_kv_blocks=64, max_model_len=32))
    assert short.scheduler.long_rope is None and short.model.rotary.long_threshold is None


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
def test_longrope_accepted_drafts_across_the_threshold(tokenizer, speculative):
    """A 12-token vocabulary loops, so drafts get accepted (a draft model equal to the target: nearly all), also up
    to the threshold, where a short-table request's drafts stop; tokens stay transformers'."""
    from jobrunner.engine import EngineConfig
    from jobrunner.engine.llm_engine import LLMEngine
    from jobrunner.engine.speculative.draft_model import DraftModel

    hf = make_phi3(LONGROPE, vocab_size=12)

    def ours():
        model = build_model(hf.config, torch.float32, torch.device("cpu"))
        load_weights(model, hf.state_dict().items())
        return model

    draft = DraftModel(ours(), tokenizer, "same") if speculative == "draft" else None
    config = EngineConfig(speculative="same" if draft else "ngram", num_kv_blocks=64, block_size=4,
                          draft_every_step=True)
    engine = LLMEngine(ours(), tokenizer, config, eos_token_ids=[2], draft=draft)
    prompts = [[(i * 7 + j) % 9 + 3 for i in range(n)] for j, n in enumerate([20, 30, 36])]
    outputs = run_checked(engine, prompts, GREEDY)
    for i, ids in enumerate(prompts):
        assert outputs[f"r{i}"].output_token_ids == hf_greedy(hf, ids, MAX_TOKENS), f"prompt {i}"
    assert engine.stats().num_accepted_tokens > 0
