"""Speculative decoding (n-gram drafts): same tokens as without, exact sampled distribution, KV bookkeeping."""

from __future__ import annotations

import pytest
import torch
from helpers import run_checked
from tiny import engine_from_hf, make_hf_model

from jobrunner.engine import EngineConfig, SamplingParams
from jobrunner.engine.request import Request
from jobrunner.engine.sampler import Sampler
from jobrunner.engine.scheduler import ScheduledRequest
from jobrunner.engine.speculative.ngram import NgramIndex
from jobrunner.engine.speculative.policy import PRIOR_ACCEPTANCE, Acceptance, StepCost, plan_drafts
from jobrunner.engine.speculative.verify import verify_drafts

VOCAB = 12  # a random model over a tiny vocabulary falls into loops: n-gram drafts get accepted


@pytest.fixture(scope="module")
def hf_small_vocab():
    return make_hf_model(vocab_size=VOCAB)


def _prompts(n: int = 4) -> list[list[int]]:
    return [[(i * 7 + j) % (VOCAB - 3) + 3 for i in range(12)] * 2 for j in range(n)]


def _run(hf, tokenizer, mode: str, params, prompts=None, **config):
    engine = engine_from_hf(hf, tokenizer, speculative=mode, **config)
    outs = run_checked(engine, prompts or _prompts(), params)
    return [outs[f"r{i}"] for i in range(len(outs))], engine


def test_ngram_index_proposes_what_followed_the_latest_match():
    index = NgramIndex(max_n=3, min_n=1)
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 5, 6, 7]
    draft, n = index.propose(tokens, 3)
    assert (draft, n) == ([1, 5, 6], 3)  # the latest earlier [5, 6, 7] was followed by 1
    tokens += [1, 2]
    assert index.propose(tokens, 4) == ([], 0)  # [1, 2], [7, 1, 2], [2]: never seen before
    tokens += [9]
    assert index.propose(tokens, 2) == ([5, 6], 1)  # only the 1-gram [9] matches


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=48, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=48, temperature=0.7, top_k=6, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, seed=3, logprobs=2, repetition_penalty=1.1,
                   frequency_penalty=0.2, n=2),
], ids=["greedy", "seeded_top_k", "penalties_logprobs_n2"])
def test_same_tokens_with_and_without_speculation(hf_small_vocab, tokenizer, params):
    by_sample = params.n > 1
    results, logprobs = {}, {}
    for mode in ("off", "ngram", "auto"):
        engine = engine_from_hf(hf_small_vocab, tokenizer, speculative=mode)
        if mode == "auto":
            # auto's plan weighs acceptance against a step-cost line fitted on wall-clock step times; timed on a
            # loaded machine it could decide never to draft. Keep its prior cost (16 fixed tokens on CPU, where
            # likely drafts pay at 4 rows) so that it drafts on acceptance alone, the same way on every machine.
            engine.speculator.cost.observe = lambda num_tokens, seconds: None
        outs = run_checked(engine, _prompts(), params, by_sample=by_sample)
        results[mode] = {k: o.output_token_ids for k, o in outs.items()}
        logprobs[mode] = {k: [e.logprob for e in o.logprobs or []] for k, o in outs.items()}
        if mode != "off":  # both speculated: the equality below compares verified drafts, not two plain runs
            stats = engine.stats()
            assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens, mode
            assert sum(o.metrics.num_accepted_tokens for o in outs.values()) == stats.num_accepted_tokens
        if mode == "ngram":
            assert engine.stats().steps < params.max_tokens + 2  # accepted drafts saved steps
    assert results["ngram"] == results["off"]
    assert results["auto"] == results["off"]
    for key, values in logprobs["off"].items():
        torch.testing.assert_close(logprobs["ngram"][key], values, atol=1e-3, rtol=0)
        torch.testing.assert_close(logprobs["auto"][key], values, atol=1e-3, rtol=0)


def test_stops_lengths_and_preemption(hf_small_vocab, tokenizer):
    # a stop string and stop token inside accepted drafts cut there; a pool too small for all rows preempts
    base = run_checked(engine_from_hf(hf_small_vocab, tokenizer), _prompts(1),
                       SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))["r0"]
    stop_text = tokenizer.decode(base.output_token_ids[20:22])
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop_text]),
              SamplingParams(max_tokens=37, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[base.output_token_ids[25]]),
              SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)]
    prompts = _prompts(4)
    off, _ = _run(hf_small_vocab, tokenizer, "off", params, prompts, num_kv_blocks=14, block_size=8)
    on, engine = _run(hf_small_vocab, tokenizer, "ngram", params, prompts, num_kv_blocks=14, block_size=8)
    assert [(o.output_token_ids, o.text, o.finish_reason) for o in on] == \
        [(o.output_token_ids, o.text, o.finish_reason) for o in off]
    assert sum(o.metrics.num_preemptions for o in on) > 0
    assert engine.stats().num_accepted_tokens > 0
    assert len(on[1].output_token_ids) == 37 and len(on[3].output_token_ids) == 3


def test_prefix_cache_never_holds_draft_kv(hf_small_vocab, tokenizer):
    # every block the speculative engine registered holds the same K/V as the same block without speculation,
    # and a second round served from those blocks gives the same tokens
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    off, ref = _run(hf_small_vocab, tokenizer, "off", params, block_size=4, num_kv_blocks=128)
    on, engine = _run(hf_small_vocab, tokenizer, "ngram", params, block_size=4, num_kv_blocks=128)
    assert engine.stats().num_accepted_tokens > 0
    ref_blocks = ref.kv_manager.pool.hash_to_block_id
    compared = 0
    for block_hash, block_id in engine.kv_manager.pool.hash_to_block_id.items():
        other = ref_blocks.get(block_hash)
        if other is None:
            continue
        a = engine.runner.kv_cache[:, :, block_id * 4:(block_id + 1) * 4]
        b = ref.runner.kv_cache[:, :, other * 4:(other + 1) * 4]
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        compared += 1
    assert compared >= len(engine.kv_manager.pool.hash_to_block_id) // 2
    again = run_checked(engine, [o.prompt_token_ids + o.output_token_ids[:20] for o in on],
                        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert engine.stats().num_cached_tokens > 0
    assert [again[f"r{i}"].output_token_ids for i in range(len(on))] == [o.output_token_ids[20:40] for o in on]


def _verify_rows(model, params: SamplingParams, draft: int, num_rows: int):
    """First tokens of num_rows seeded requests that all drafted `draft` after the same context."""
    torch.manual_seed(0)
    hidden = torch.randn(1, model.shape.hidden_size).repeat(2 * num_rows, 1)
    sampling = []
    for seed in range(num_rows):
        request = Request(f"q{seed}", [3, 4, 5], params, 0.0, seed=seed)
        request.output_token_ids = [6]
        sampling.append(ScheduledRequest(request, 1, 3, [draft]))
    with torch.inference_mode():
        sampled, _, verified = verify_drafts(model, Sampler(torch.device("cpu")), hidden,
                                             torch.arange(2 * num_rows), sampling)
        logits = model.compute_logits(hidden[:1])[0]
    accepted = [verified[s.request.key].num_accepted == 1 for s in sampling]
    return logits, [sampled[s.request.key] for s in sampling], accepted


@pytest.mark.parametrize("top_k", [0, 4])
def test_rejection_sampling_keeps_the_target_distribution(top_k):
    # a draft is accepted with probability p(draft); on rejection the token follows p without the draft
    # (renormalized): together, the first token is distributed as p. 6,000 seeded rows, vocabulary 8.
    model = LlamaTiny.build(vocab=8)
    params = SamplingParams(temperature=0.8, top_k=top_k, max_tokens=8)
    logits, tokens, accepted = _verify_rows(model, params, draft=3, num_rows=6000)
    scaled = logits.float() / 0.8
    if top_k:
        scaled[scaled < scaled.topk(top_k).values[-1]] = float("-inf")
    p = torch.softmax(scaled, dim=-1)
    counts = torch.bincount(torch.tensor(tokens), minlength=8).float()
    freq = counts / counts.sum()
    assert (freq - p).abs().sum() / 2 < 0.03  # total variation; the sampling error here is about 0.01
    assert abs(sum(accepted) / len(accepted) - float(p[3])) < 0.03
    rejected = torch.tensor([t for t, a in zip(tokens, accepted) if not a])
    residual = p.clone()
    residual[3] = 0
    residual /= residual.sum()
    freq_rej = torch.bincount(rejected, minlength=8).float() / len(rejected)
    assert freq_rej[3] == 0 and (freq_rej - residual).abs().sum() / 2 < 0.04


class LlamaTiny:
    @staticmethod
    def build(vocab: int):
        from jobrunner.models.loader import build_model, load_weights

        hf = make_hf_model(vocab_size=vocab, seed=1)
        model = build_model(hf.config, torch.float32, torch.device("cpu"))
        load_weights(model, hf.state_dict().items())
        return model


def test_plan_speculates_in_the_tail_not_at_full_batch():
    # acceptance 0.7, a step's fixed cost worth 16 tokens: one row takes its whole draft, 64 rows none
    assert plan_drafts([(0.7, 0.7)], [4], 1, 1, 16.0) == [4]
    assert plan_drafts([(0.7, 0.7)] * 64, [4] * 64, 64, 64, 16.0) == [0] * 64
    assert plan_drafts([(0.05, 0.05)], [4], 1, 1, 16.0) == [0]  # a poor acceptance never pays
    mixed = plan_drafts([(0.95, 0.95), (0.3, 0.3)], [4, 4], 8, 8, 16.0)
    assert mixed[0] > 0 and mixed[1] == 0
    # a draft that rarely starts right is not verified at batch 8, however sure its continuation
    assert plan_drafts([(0.2, 0.95)], [4], 8, 8, 16.0) == [0]
    assert plan_drafts([(0.2, 0.95)], [4], 1, 1, 16.0) == [4]


def test_acceptance_splits_first_and_later_draft_tokens():
    acceptance = Acceptance()
    for _ in range(100):  # drafts of 4: 1 in 5 starts right and then runs to the end
        acceptance.record_draft(3, 4, 0)
        acceptance.record_draft(3, 4, 0)
        acceptance.record_draft(3, 4, 0)
        acceptance.record_draft(3, 4, 0)
        acceptance.record_draft(3, 4, 4)
    first, later = acceptance.alpha(3)
    assert abs(first - 0.2) < 0.02 and later > 0.97
    assert acceptance.alpha(1) == (PRIOR_ACCEPTANCE, PRIOR_ACCEPTANCE)  # nothing seen for n = 1


def test_step_cost_is_fitted_near_the_step_size():
    # weight-bound up to 8 tokens (10 ms a step), then 1 ms per token: nearly free drafts at batch 1, none at 64
    def seconds(x: int) -> float:
        return 0.010 + 0.00001 * x if x <= 8 else 0.001 * x + 0.002

    cost = StepCost(16.0)
    for x in (1, 2, 3, 4, 5) * 4:
        cost.observe(x, seconds(x))
    assert cost.fixed_tokens(1) > 100  # a batch-1 engine: drafts nearly free
    for x in (32, 40, 48, 56, 64) * 4:
        cost.observe(x, seconds(x))
    assert cost.fixed_tokens(64) < 4 < cost.fixed_tokens(1) == cost.fixed_tokens()  # capped by the overall fit
    assert StepCost(16.0).fixed_tokens(8) == 16.0  # the prior until steps of several sizes are seen


def test_speculative_setting_is_checked():
    for bad in ("", " ngram"):  # anything else names a draft model, loaded (and checked) by the engine
        with pytest.raises(ValueError, match="speculative"):
            EngineConfig(speculative=bad)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)
