"""The native row argmax (engine/sampling/argmax.py, csrc/row_argmax.c) against ``torch.max(dim=-1).indices``
per forced capability, float32 and bf16, many shapes and thread counts, ties, NaN and infinities; every fallback
to torch; and the sampler's greedy fast path: the same tokens as the float32 path, in an engine run too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import run_checked
from tiny import CORPUS

from jobrunner.engine import EngineConfig, SamplingParams
from jobrunner.engine import sampler as sampler_module
from jobrunner.engine.llm_engine import LLMEngine
from jobrunner.engine.sampling import argmax
from jobrunner.kernels import CAPABILITY_ENV
from jobrunner.models.loader import build_model, load_weights
from tests.components import require_library

HAS_AVX2 = " avx2" in Path("/proc/cpuinfo").read_text(encoding="utf-8")
NAN, INF = float("nan"), float("inf")


@pytest.fixture(params=["native", "avx2", "default"])
def capability(request, monkeypatch):
    if request.param != "native":
        if request.param == "avx2" and not HAS_AVX2:
            pytest.skip("this CPU has no AVX2")
        monkeypatch.setenv(CAPABILITY_ENV, request.param)
    require_library(argmax.argmax_library())
    return request.param


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _check(x: torch.Tensor, thread_counts=(1, 2, 3)) -> None:
    want = x.max(dim=-1).indices
    for n in thread_counts:
        torch.set_num_threads(n)
        got = argmax.native_row_argmax(x)
        assert got is not None and got.dtype == torch.int64
        assert torch.equal(got, want), (tuple(x.shape), x.dtype, n, (got != want).nonzero()[:5].tolist())


def _specials(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows, then rows of ties, NaN (one or two), +-inf, all -inf, all equal, -0 / +0, ties across the
    vector lanes, the block boundaries and the scalar tail."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen).to(dtype)
    last = vocab - 1
    edits = [
        lambda r: r.fill_(INF * -1),                                      # all -inf: index 0
        lambda r: r.fill_(0.5),                                           # all equal: index 0
        lambda r: r.__setitem__(slice(None), torch.randint(0, 3, (vocab,), generator=gen).to(dtype)),  # many ties
        lambda r: r.__setitem__(last, NAN),                               # NaN in the tail
        lambda r: (r.__setitem__(last // 2, NAN), r.__setitem__(last, NAN)),  # the first NaN wins
        lambda r: (r.__setitem__(0, INF), r.__setitem__(last, INF)),     # +inf twice
        lambda r: (r.__setitem__(last, INF), r.__setitem__(last // 3, NAN)),  # NaN beats +inf
        lambda r: (r.fill_(-1.0), r.__setitem__(last, 0.0), r.__setitem__(last // 2, -0.0)),  # -0 == +0
        lambda r: (r.fill_(-INF), r.__setitem__(last, -3.0)),             # the last element alone
        lambda r: r.__setitem__(slice(None), torch.arange(vocab, dtype=torch.float32).to(dtype)),  # rises
        lambda r: (r.__setitem__(min(1024, last), 9.0), r.__setitem__(min(1023, last), 9.0)),  # a block edge tie
        lambda r: r.__setitem__(slice(None), -torch.rand(vocab, generator=gen).to(dtype) * 3.0e38),
    ]
    for i in range(min(rows, len(edits))):
        edits[i](x[(i * 7) % rows] if rows > 1 else x[0])
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 64, 130])
def test_matches_torch_max_indices(capability, threads, dtype, rows):
    for vocab in (1, 7, 15, 33, 63, 64, 65, 127, 1000, 1024, 1031, 4099, 12345):
        _check(_specials(rows, vocab, dtype, rows * 100003 + vocab))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,vocab", [(1, 49152), (3, 49152), (5, 32001), (64, 49152), (2, 152067)])
def test_large_vocabularies_split_rows_and_row_strides(capability, threads, dtype, rows, vocab):
    x = _specials(rows, vocab, dtype, rows + vocab)
    _check(x)
    wide = torch.zeros(rows, vocab + 37, dtype=dtype)  # rows vocab + 37 elements apart (a column slice)
    wide[:, 5:5 + vocab] = x
    _check(wide[:, 5:5 + vocab], (2,))
    _check(x[::2], (1, 2))  # every other row


def test_fallbacks_are_none_and_greedy_argmax_still_answers(monkeypatch):
    x = torch.randn(4, 100)
    assert argmax.native_row_argmax(x.half()) is None                  # float16
    assert argmax.native_row_argmax(x.double()) is None                # float64
    assert argmax.native_row_argmax(x.t()) is None                     # columns not contiguous
    assert argmax.native_row_argmax(x[0]) is None                      # 1-D
    assert argmax.native_row_argmax(torch.zeros(3, 0)) is None         # empty rows: torch raises as it would
    grad = torch.randn(2, 50, requires_grad=True)
    assert argmax.native_row_argmax(grad) is None
    monkeypatch.setenv(argmax.ARGMAX_ENV, "0")
    assert argmax.argmax_library() == f"{argmax.ARGMAX_ENV}=0"
    assert argmax.native_row_argmax(x) is None
    assert torch.equal(argmax.greedy_argmax(x), x.max(dim=-1).indices)
    assert torch.equal(argmax.greedy_argmax(x.half()), x.half().max(dim=-1).indices)


def test_no_compiler_means_torch(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv(CAPABILITY_ENV, "default")
    monkeypatch.setenv("XDG_CACHE_HOME", "/nonexistent-cache")
    argmax._library.cache_clear()
    try:
        assert "no C compiler" in argmax.argmax_library()
        x = torch.randn(3, 70).bfloat16()
        assert argmax.native_row_argmax(x) is None
        assert torch.equal(argmax.greedy_argmax(x), x.max(dim=-1).indices)
    finally:
        argmax._library.cache_clear()


# -- the sampler's fast path ------------------------------------------------------------------------------------

class _Grammar:
    def __init__(self, terminated: bool) -> None:
        self.is_terminated = terminated


class _Request:
    """What the sampler reads of a request."""

    def __init__(self, params: SamplingParams, num_output_tokens: int = 0, grammar=None) -> None:
        self.params = params
        self.num_output_tokens = num_output_tokens
        self.grammar = grammar


def test_plain_greedy_names_every_step_that_reads_float_logits():
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    assert sampler_module.plain_greedy(_Request(greedy))
    assert sampler_module.plain_greedy(_Request(greedy, grammar=_Grammar(terminated=True)))
    assert sampler_module.plain_greedy(_Request(SamplingParams(temperature=0.0, max_tokens=8, min_tokens=2), 2))
    for request in (
        _Request(SamplingParams(temperature=1.0, max_tokens=8)),
        _Request(SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)),
        _Request(SamplingParams(temperature=0.0, max_tokens=8, logit_bias={3: 1.0})),
        _Request(SamplingParams(temperature=0.0, max_tokens=8, min_tokens=2), 1),
        _Request(SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.1)),
        _Request(SamplingParams(temperature=0.0, max_tokens=8, presence_penalty=0.5)),
        _Request(SamplingParams(temperature=0.0, max_tokens=8, frequency_penalty=0.5)),
        _Request(greedy, grammar=_Grammar(terminated=False)),
    ):
        assert not sampler_module.plain_greedy(request), request.params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sampler_fast_path_gives_the_float32_tokens(monkeypatch, dtype):
    require_library(argmax.argmax_library())
    calls = _count_native(monkeypatch)
    x = _specials(40, 1031, dtype, 7)
    requests = [_Request(SamplingParams(temperature=0.0, max_tokens=8)) for _ in range(40)]
    sampler = sampler_module.Sampler(torch.device("cpu"))
    fast = sampler.sample(x, requests)
    assert calls == [True]
    assert fast.token_ids == x.float().max(dim=-1).indices.tolist() and fast.logprobs == [None] * 40
    sampler.invariant = True  # deterministic mode: the same (exact) argmax
    assert sampler.sample(x, requests).token_ids == fast.token_ids
    monkeypatch.setenv(argmax.ARGMAX_ENV, "0")
    assert sampler.sample(x, requests).token_ids == fast.token_ids
    monkeypatch.delenv(argmax.ARGMAX_ENV)
    calls.clear()
    requests[3] = _Request(SamplingParams(temperature=0.0, max_tokens=8, logprobs=1))  # one row needs float32
    out = sampler.sample(x, requests)
    assert calls == [] and out.token_ids == fast.token_ids and out.logprobs[3] is not None


def _count_native(monkeypatch) -> list[bool]:
    """Spy on the sampler's native argmax: one entry per call, whether it answered."""
    calls: list[bool] = []

    def spy(x):
        out = argmax.native_row_argmax(x)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(sampler_module, "native_row_argmax", spy)
    return calls


def _engine(hf_model, tokenizer, dtype: torch.dtype, **config) -> LLMEngine:
    model = build_model(hf_model.config, dtype, torch.device("cpu"))
    load_weights(model, hf_model.state_dict().items())
    config.setdefault("num_kv_blocks", 256)
    return LLMEngine(model, tokenizer, EngineConfig(**config), eos_token_ids=[tokenizer.eos_token_id])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("config", [dict(speculative="off"), dict(speculative="ngram"),
                                    dict(speculative="off", deterministic=True)],
                         ids=["plain", "ngram", "deterministic"])
def test_engine_greedy_outputs_identical_with_the_fast_path_on_and_off(monkeypatch, hf_llama, tokenizer, dtype,
                                                                       config):
    require_library(argmax.argmax_library())
    prompts = CORPUS[:12]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    mixed = [greedy, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, min_tokens=4),
             greedy, SamplingParams(max_tokens=6, temperature=0.8, seed=5, ignore_eos=True)] * 3
    outs = {}
    for on in (True, False):
        if not on:
            monkeypatch.setenv(argmax.ARGMAX_ENV, "0")
        calls = _count_native(monkeypatch)
        for name, params in (("greedy", greedy), ("mixed", mixed)):
            engine = _engine(hf_llama, tokenizer, dtype, max_num_seqs=8, **config)
            got = run_checked(engine, prompts, params)
            outs[on, name] = [got[f"r{i}"].output_token_ids for i in range(len(prompts))]
        assert any(calls) == on  # on: some steps took the native argmax; off: none could
    assert outs[True, "greedy"] == outs[False, "greedy"]
    assert outs[True, "mixed"] == outs[False, "mixed"]
