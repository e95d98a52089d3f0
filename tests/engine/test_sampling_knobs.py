"""Sampling knobs against transformers' logits processors on random logits, then through the engine."""

import math

import pytest
import torch
from tiny import CORPUS, engine_from_hf
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from jobrunner.engine import SamplingParams
from jobrunner.engine.sampling import filters, penalties
from jobrunner.engine.sampling.noise import gumbel, keys_tensor, row_key, uniform_reference

VOCAB = 50


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


def test_repetition_penalty_matches_transformers(logits):
    input_ids = torch.tensor([[1, 4, 4, 9], [0, 2, 3, 49], [7, 7, 7, 7]])
    expected = RepetitionPenaltyLogitsProcessor(1.7)(input_ids, logits.clone())
    ours = logits.clone()
    seen = penalties.token_counts(input_ids.tolist(), VOCAB, ours.device)
    penalties.apply_repetition_penalty(ours, seen, torch.full((3,), 1.7))
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_presence_and_frequency_penalties_follow_openai(logits):
    outputs = [[5, 5, 5, 8], [], [0]]
    ours = logits.clone()
    penalties.apply_penalties(ours, [0, 1, 2], [[1], [1], [1]], outputs, [1.0] * 3, [0.5, 0.5, -1.0],
                              [0.25, 0.25, 2.0])
    expected = logits.clone()
    expected[0, 5] -= 0.25 * 3 + 0.5
    expected[0, 8] -= 0.25 * 1 + 0.5
    expected[2, 0] -= 2.0 * 1 - 1.0
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3])
def test_min_p_matches_transformers(logits, min_p):
    expected = MinPLogitsWarper(min_p)(None, logits.clone())
    ours = filters.apply_min_p(logits.clone(), torch.full((3,), min_p))
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    torch.testing.assert_close(ours[~torch.isinf(ours)], expected[~torch.isinf(expected)])


@pytest.mark.parametrize("top_p", [0.3, 0.8, 1.0])
def test_top_p_matches_transformers(logits, top_p):
    expected = TopPLogitsWarper(top_p)(None, logits.clone())
    ours = filters.filter_full(logits.clone(), torch.full((3,), top_p), torch.zeros(3))
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))


@pytest.mark.parametrize("top_k, top_p", [(1, 1.0), (7, 1.0), (7, 0.5), (VOCAB, 0.9)])
def test_top_k_path_keeps_what_transformers_keeps(logits, top_k, top_p):
    scaled = TemperatureLogitsWarper(0.7)(None, logits.clone())
    expected = TopPLogitsWarper(top_p)(None, TopKLogitsWarper(top_k)(None, scaled.clone()))
    values, ids = filters.filter_top_k(scaled, [top_k] * 3, torch.full((3,), top_p), torch.zeros(3))
    for row in range(3):
        kept = set(ids[row][~torch.isinf(values[row])].tolist())
        assert kept == set(torch.nonzero(~torch.isinf(expected[row])).flatten().tolist())


def test_min_tokens_matches_transformers(logits):
    eos = [2, 9]
    input_ids = torch.zeros(3, 6, dtype=torch.long)  # a 4-token prompt + 2 new tokens
    expected = MinNewTokensLengthLogitsProcessor(4, 3, eos)(input_ids, logits.clone())
    ours = logits.clone()
    penalties.apply_banned_tokens(ours, [0, 1, 2], [eos] * 3)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_logit_bias_matches_transformers(logits):
    bias = {3: 5.0, 17: -2.5}
    expected = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(torch.zeros(3, 2, dtype=torch.long),
                                                                                 logits.clone())
    ours = logits.clone()
    penalties.apply_logit_bias(ours, [0, 1, 2], [bias] * 3)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_gumbel_noise_equals_the_plain_python_hash():
    raw = [row_key(11, 0), row_key(2**62 + 5, 17), row_key(0, 3)]
    ids = torch.tensor([[0, 1, 49_151, 151_935, 7]])
    noise = gumbel(keys_tensor(raw, torch.device("cpu")), ids)
    for r, key in enumerate(raw):
        expected = [-math.log(-math.log(uniform_reference(key >> 1, t))) for t in ids[0].tolist()]
        assert noise[r].tolist() == pytest.approx(expected, rel=1e-5)


def test_gumbel_noise_is_a_pure_function_of_key_and_token():
    keys = keys_tensor([row_key(11, 0), row_key(11, 1), row_key(12, 0)], torch.device("cpu"))
    ids = torch.arange(1000)[None, :]
    noise = gumbel(keys, ids)
    assert torch.equal(gumbel(keys[1:2], torch.tensor([[5, 900]])), noise[1:2, [5, 900]])
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    # Gumbel(0, 1): mean = Euler-Mascheroni constant, variance = pi^2 / 6
    assert noise.mean().item() == pytest.approx(0.5772, abs=0.05)
    assert noise.var().item() == pytest.approx(1.6449, abs=0.1)


def test_sampling_frequencies_follow_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    draws = [filters.sample_full(logits, torch.ones(1), torch.ones(1), torch.zeros(1),
                                 keys_tensor([row_key(99, pos)], torch.device("cpu"))).item() for pos in range(4000)]
    freqs = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    torch.testing.assert_close(freqs, torch.softmax(logits[0], dim=0), atol=0.025, rtol=0)


# -- through the engine ------------------------------------------------------------------------------------


@pytest.fixture
def engine(hf_llama, tokenizer):
    return engine_from_hf(hf_llama, tokenizer, block_size=4)


def test_min_tokens_masks_eos_until_reached(engine, tokenizer):
    eos = tokenizer.eos_token_id
    push_eos = {eos: 100.0}  # EOS would win every step
    outs = engine.generate([CORPUS[0]] * 2, [SamplingParams(max_tokens=10, temperature=0, logit_bias=push_eos),
                                             SamplingParams(max_tokens=10, temperature=0, logit_bias=push_eos,
                                                            min_tokens=4)])
    assert outs[0].output_token_ids == [eos]
    assert len(outs[1].output_token_ids) == 5 and outs[1].output_token_ids[-1] == eos
    assert eos not in outs[1].output_token_ids[:4] and outs[1].finish_reason == "stop"


def test_logit_bias_keys_may_be_strings(engine):
    out = engine.generate([CORPUS[0]], SamplingParams(max_tokens=4, temperature=1.0, seed=1,
                                                      logit_bias={"42": 100}))[0]
    assert out.output_token_ids == [42] * 4


def test_include_stop_str_in_output(engine):
    base = engine.generate([CORPUS[1]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    stop = base.text[5:8]
    cut = base.text.index(stop)
    outs = engine.generate([CORPUS[1]] * 2, [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)])
    assert outs[0].text == base.text[:cut]
    assert outs[1].text == base.text[:cut + len(stop)]
    assert outs[0].finish_reason == outs[1].finish_reason == "stop"


def test_penalties_change_greedy_output(engine):
    plain, penalized = engine.generate([CORPUS[3]] * 2, [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0)])
    assert len(set(penalized.output_token_ids)) >= len(set(plain.output_token_ids))
    assert penalized.output_token_ids != plain.output_token_ids


@pytest.mark.parametrize("values, name", [
    ({"min_p": 1.5}, "min_p"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"3": 500}}, "logit_bias"), ({"include_stop_str_in_output": "yes"}, "include_stop_str"),
])
def test_bad_knob_values_are_named(values, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams.from_dict(values)


def test_uniform_never_reaches_one_so_noise_stays_finite():
    # every hash value, the extremes included: a uniform of exactly 1.0 would give +inf noise, and
    # +inf + -inf = NaN would win the argmax over a masked (filtered or grammar-forbidden) token
    from jobrunner.engine.sampling.noise import uniform_from_bits

    bits = torch.tensor([0, 1, 511, 512, 2**31 - 1, -(2**31), -1], dtype=torch.int32)
    u = uniform_from_bits(bits)
    assert bool(((u > 0) & (u < 1)).all())
    assert float(u.max()) == 1 - 2**-24 and float(u.min()) == 2**-24
    assert bool(torch.isfinite(-torch.log(-torch.log(u))).all())


def test_masked_tokens_are_never_drawn():
    # a row where only 3 tokens may come (as under a grammar mask), sampled at many positions
    logits = torch.full((1, 49152), float("-inf"))
    allowed = torch.tensor([7, 3000, 40000])
    logits[0, allowed] = torch.tensor([1.0, 0.5, 0.2])
    for position in range(2000):
        keys = keys_tensor([row_key(11, position)], torch.device("cpu"))
        token = int(filters.sample_full(logits, torch.tensor([0.8]), torch.tensor([0.95]), torch.tensor([0.0]),
                                        keys, True))
        assert token in allowed.tolist(), position


def test_top_p_from_candidates_draws_what_the_full_sort_draws():
    # peaked rows take the candidate path (top-p mass within the best 1,024), flat rows and top_p = 1 rows the
    # sort; every row must draw exactly what the sort-based draw over the whole vocabulary gives
    torch.manual_seed(3)
    vocab = 49152
    logits = torch.randn(6, vocab)
    logits[:3] *= 12.0                                   # peaked: candidates hold the mass
    top_ps = torch.tensor([0.9, 0.5, 0.99, 0.95, 1.0, 0.8])
    temps, min_ps = torch.tensor([0.8, 1.0, 1.2, 0.7, 1.0, 1.0]), torch.tensor([0.0, 0.0, 0.05, 0.0, 0.0, 0.0])
    for position in range(40):
        keys = keys_tensor([row_key(seed, position) for seed in range(6)], torch.device("cpu"))
        ours = filters.sample_full(logits, temps, top_ps, min_ps, keys, True)
        scaled = filters.filter_full(logits / temps[:, None], top_ps, min_ps)
        reference = (scaled + gumbel(keys, torch.arange(vocab)[None, :])).argmax(dim=-1)
        assert ours.tolist() == reference.tolist(), position
