"""Draft-model speculation: same tokens as without, the draft's KV bookkeeping, the tokenizer check, the plan."""

from __future__ import annotations

import pytest
import torch
from tiny import make_hf_model, make_tokenizer

from jobrunner.engine import EngineConfig, SamplingParams
from jobrunner.engine.llm_engine import LLMEngine
from jobrunner.engine.speculative.draft_model import DraftModel
from jobrunner.engine.speculative.draft_speculator import plan_with_draft
from jobrunner.models.loader import build_model, load_weights

VOCAB = 12  # random models over a tiny vocabulary fall into loops: a second random model's drafts get accepted


@pytest.fixture(scope="module")
def target_hf():
    return make_hf_model(vocab_size=VOCAB)


@pytest.fixture(scope="module")
def other_hf():
    return make_hf_model(vocab_size=VOCAB, seed=1, num_hidden_layers=1)


def _model(hf) -> torch.nn.Module:
    model = build_model(hf.config, torch.float32, torch.device("cpu"))
    load_weights(model, hf.state_dict().items())
    return model


def _engine(target_hf, tokenizer, draft_hf=None, draft_tokenizer=None, **config) -> LLMEngine:
    draft = None
    if draft_hf is not None:
        draft = DraftModel(_model(draft_hf), draft_tokenizer or tokenizer, "tiny-draft")
        config.setdefault("speculative", "tiny-draft")
    config.setdefault("num_kv_blocks", 64)
    return LLMEngine(_model(target_hf), tokenizer, EngineConfig(**config), eos_token_ids=[tokenizer.eos_token_id],
                     model_info={"source": "tiny-target"}, draft=draft)


def _prompts(n: int = 4) -> list[list[int]]:
    return [[(i * 7 + j) % (VOCAB - 3) + 3 for i in range(12)] * 2 for j in range(n)]


def _run(engine: LLMEngine, prompts, params) -> list:
    """Step to completion; after every step check the target's and the draft's KV bookkeeping."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    outs = {}
    proposer = getattr(engine.speculator, "proposer", None)
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
        engine.check_integrity()
        if proposer is not None:  # draft blocks are held only by running requests' draft sequences
            proposer.kv.check_integrity(list(proposer.seqs.values()))
            assert set(proposer.seqs) <= {r.key for r in engine.scheduler.running}
    if proposer is not None:
        assert proposer.num_used_blocks == 0 and not proposer.seqs
    return [outs[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.8, top_k=6, seed=5, ignore_eos=True),
], ids=["greedy", "seeded_top_k"])
def test_same_tokens_with_a_draft_model(target_hf, other_hf, tokenizer, params):
    off = [o.output_token_ids for o in _run(_engine(target_hf, tokenizer), _prompts(3), params)]
    drafts = (other_hf, target_hf) if params.is_greedy else (other_hf,)
    for draft_hf in drafts:
        engine = _engine(target_hf, tokenizer, draft_hf, draft_every_step=True, num_speculative_tokens=3)
        assert [o.output_token_ids for o in _run(engine, _prompts(3), params)] == off
        stats = engine.stats()
        assert stats.num_draft_tokens > 0
        if draft_hf is target_hf:  # the target as its own draft: every draft accepted
            assert stats.num_accepted_tokens == stats.num_draft_tokens
            assert stats.steps <= params.max_tokens // 4 + 1


def test_planned_drafts_give_the_same_tokens(target_hf, other_hf, tokenizer):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    off = [o.output_token_ids for o in _run(_engine(target_hf, tokenizer), _prompts(2), params)]
    engine = _engine(target_hf, tokenizer, other_hf, num_speculative_tokens=3)
    assert [o.output_token_ids for o in _run(engine, _prompts(2), params)] == off
    assert engine.stats().num_draft_tokens > 0  # probed (optimistic acceptance until measured), then measured
    assert set(engine.speculator.stats()["alpha"]) == {0}  # the draft's acceptance, measured in its own bucket


def test_preemption_and_finish_give_the_draft_kv_back(target_hf, other_hf, tokenizer):
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (32, 29, 3, 24)]
    off = _run(_engine(target_hf, tokenizer, num_kv_blocks=14, block_size=8), _prompts(), params)
    engine = _engine(target_hf, tokenizer, other_hf, draft_every_step=True, num_kv_blocks=14, block_size=8,
                     num_speculative_tokens=3)
    on = _run(engine, _prompts(), params)  # _run checks the draft pool after every step and at the end
    assert [o.output_token_ids for o in on] == [o.output_token_ids for o in off]
    assert sum(o.metrics.num_preemptions for o in on) > 0
    assert engine.stats().num_draft_tokens > 0
    assert engine.speculator.proposer.kv.num_blocks == 14  # the draft holds the same tokens: as many blocks


def test_a_draft_with_another_tokenizer_is_refused_naming_both(target_hf, tokenizer):
    with pytest.raises(ValueError, match=r"draft model 'tiny-draft' does not share the tokenizer of the target "
                                         r"model 'tiny-target': vocabulary size 16 \(draft\) vs 12 \(target\)"):
        _engine(target_hf, tokenizer, make_hf_model(vocab_size=16))
    with pytest.raises(ValueError, match=r"tokenizer fingerprint .* token strings map to other ids"):
        _engine(target_hf, tokenizer, target_hf, draft_tokenizer=make_tokenizer(vocab_size=300))


def test_an_unknown_draft_source_names_the_setting(target_hf, tokenizer):
    with pytest.raises(ValueError, match=r"engine\.speculative: the draft model could not be loaded: model source "
                                         r"'no-such-draft' is not a known alias"):
        _engine(target_hf, tokenizer, speculative="no-such-draft")


def test_memory_plan_counts_the_draft(target_hf, other_hf, tokenizer):
    budget = 1 << 20
    alone = _engine(target_hf, tokenizer, num_kv_blocks=None, kv_cache_memory_bytes=budget)
    both = _engine(target_hf, tokenizer, other_hf, num_kv_blocks=None, kv_cache_memory_bytes=budget)
    per_block = 2 * 16 * 2 * 16 * 4  # K and V, 16 tokens, 2 kv heads, head_dim 16, float32, per layer
    assert alone.kv_manager.num_blocks == budget // (2 * per_block)
    assert both.kv_manager.num_blocks == budget // (2 * per_block + 1 * per_block)  # + the 1-layer draft
    info = both.model_info
    assert info["draft_kv_bytes"] == both.kv_manager.num_blocks * per_block
    assert info["draft_weight_bytes"] < info["weight_bytes"] and info["draft_source"] == "tiny-draft"


def test_plan_with_draft_drafts_at_batch_1_and_not_at_full_batch():
    # a cheap, accurate draft (a tenth of the target's cost) at batch 1: draft deep
    assert plan_with_draft(0.9, [4], 1, 1, 16.0, 1.6, 0.1) == [4]
    # the same at batch 64: the step is no longer dominated by its fixed cost, drafting never pays
    assert plan_with_draft(0.9, [4] * 64, 64, 64, 16.0, 1.6, 0.1) == [0] * 64
    # a draft as costly as the target itself, accepted half the time, never pays
    assert plan_with_draft(0.5, [4], 1, 1, 16.0, 16.0, 1.0) == [0]
