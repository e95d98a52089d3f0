"""One-step-late readback (engine/readback.py, a mode of LLMEngine.step), on the CPU with ``late_readback="always"``:
outputs, texts, logprobs and per-request counts equal the synchronous path's, whatever stops a row, with queueing,
prefix hits, preemption, rows that must be read at once, and the fixed-shape (graph twin) path."""

from __future__ import annotations

import pytest
import torch
from helpers import run_checked
from tiny import CORPUS, engine_from_hf

from jobrunner.attention.input_patch import patch_input_ids
from jobrunner.engine import EngineConfig, SamplingParams
from jobrunner.engine.readback import can_read_late, late_readback_on
from jobrunner.engine.request import PENDING_TOKEN, Request
from tests.components import require_import

SHARED = "The quick brown fox jumps over the lazy dog. " * 2          # prefix-cache hits across rows
PROMPTS = [SHARED + "Then what?", CORPUS[1], "Hi", SHARED + "And after that", CORPUS[3][:40], CORPUS[4],
           SHARED + "Why?", "One two three"]
COUNTS = ("num_prompt_tokens", "num_cached_tokens", "num_output_tokens", "num_preemptions")


def _params(stop_ids: dict[int, int], stop_text: str | None = None, longer: int = 0) -> list[SamplingParams]:
    """Greedy and seeded rows; some stop on a token they generate mid-way (stop_token_ids: an EOS-like stop the
    host only sees one step late), one on a stop string, others at max_tokens, with logprobs and min_tokens."""
    out = []
    for i in range(len(PROMPTS)):
        kw = dict(max_tokens=6 + 3 * (i % 4) + longer, ignore_eos=True, seed=100 + i)
        kw["temperature"] = 0.0 if i % 2 == 0 else 0.9
        if i in stop_ids:
            kw["stop_token_ids"] = [stop_ids[i]]
        if i == 3:
            kw["logprobs"] = 2
        if i == 5:
            kw["min_tokens"] = 4
        if i == 6 and stop_text:
            kw["stop"] = [stop_text]
        out.append(SamplingParams(**kw))
    return out


def _run(hf, tokenizer, params, **settings):
    engine = engine_from_hf(hf, tokenizer, speculative="off", **settings)
    return engine, run_checked(engine, PROMPTS, params)


def o_max(params: list[SamplingParams], key: str) -> int:
    return params[int(key[1:])].max_tokens


def _same(late: dict, sync: dict, exact: bool = False) -> None:
    assert late.keys() == sync.keys()
    for key, want in sync.items():
        got = late[key]
        assert got.output_token_ids == want.output_token_ids, key
        assert (got.text, got.finish_reason, got.error) == (want.text, want.finish_reason, want.error), key
        assert [getattr(got.metrics, c) for c in COUNTS] == [getattr(want.metrics, c) for c in COUNTS], key
        if want.logprobs is not None:  # a step's batch may differ (a dropped row, an admission a step later):
            # float32 GEMM rounding moves logprobs by ~1e-7, exact in deterministic mode
            assert [(e.token_id, [t.token_id for t in e.top_logprobs]) for e in got.logprobs] == \
                   [(e.token_id, [t.token_id for t in e.top_logprobs]) for e in want.logprobs], key
            for a, b in zip(got.logprobs, want.logprobs):
                assert a.logprob == (b.logprob if exact else pytest.approx(b.logprob, abs=1e-5)), key


def _stopping(hf, tokenizer, settings, longer: int = 0) -> list[SamplingParams]:
    """Params whose rows 0, 1, 4, 7 stop on a token each generates at its 2nd-4th position, row 6 on a piece
    of its own text (found by a free run)."""
    _, free = _run(hf, tokenizer, _params({}, longer=longer), **settings)
    stop_ids = {i: free[f"r{i}"].output_token_ids[1 + i % 3] for i in (0, 1, 4, 7)}
    return _params(stop_ids, free["r6"].text[4:7], longer)


@pytest.mark.parametrize("static_decode", [False, True])
def test_late_readback_gives_the_synchronous_outputs(hf_llama, tokenizer, static_decode):
    settings = dict(block_size=8, max_num_seqs=3, max_num_batched_tokens=48, static_decode=static_decode)
    params = _stopping(hf_llama, tokenizer, settings)
    sync_engine, sync = _run(hf_llama, tokenizer, params, **settings)
    late_engine, late = _run(hf_llama, tokenizer, params, late_readback="always", **settings)
    _same(late, sync)
    assert {sync[f"r{i}"].finish_reason for i in (0, 1, 4, 6)} == {"stop"}      # stops the host saw late
    stats, sync_stats = late_engine.stats(), sync_engine.stats()
    # one step for nothing per row that stopped on what it generated before its last allowed token; none for
    # rows that reached max_tokens (not scheduled while their last token is on its way)
    assert stats.num_late_steps > 0
    early = [k for k, o in sync.items() if o.finish_reason == "stop" and len(o.output_token_ids) < o_max(params, k)]
    assert stats.num_late_discarded_tokens == len(early) > 0
    assert late_engine._held is None          # nothing left held once every request is out
    assert sync_stats.num_late_steps == 0 and stats.num_cached_tokens == sync_stats.num_cached_tokens > 0
    assert stats.num_output_tokens == sync_stats.num_output_tokens
    assert stats.num_sampled_tokens == sync_stats.num_sampled_tokens          # dropped tokens are not counted
    if static_decode:
        assert stats.num_fixed_shape_steps > 0


def test_late_readback_in_deterministic_mode_is_bit_exact(hf_llama, tokenizer):
    """Batch-invariant execution: a step's batch no longer matters, so even logprobs are bit for bit equal."""
    settings = dict(block_size=8, max_num_seqs=3, max_num_batched_tokens=48, deterministic=True)
    params = _stopping(hf_llama, tokenizer, settings)
    _, sync = _run(hf_llama, tokenizer, params, **settings)
    late_engine, late = _run(hf_llama, tokenizer, params, late_readback="always", **settings)
    _same(late, sync, exact=True)
    assert late_engine.stats().num_late_steps > 0


def test_late_readback_under_kv_pressure(hf_llama, tokenizer):
    """A pool too small for every row: preemption, recomputation, evicted prefix blocks. Tokens, texts and
    preemptions match the synchronous path (a step that may preempt reads the last one first); strict mode
    (read first while a request waits) also keeps every admission, so the prefix-cache hits match too."""
    settings = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=24)
    params = _stopping(hf_llama, tokenizer, settings, longer=10)
    sync_engine, sync = _run(hf_llama, tokenizer, params, **settings)
    assert sync_engine.stats().num_preemptions > 0
    late_engine, late = _run(hf_llama, tokenizer, params, late_readback="always", **settings)
    for key, want in sync.items():
        assert (late[key].output_token_ids, late[key].text) == (want.output_token_ids, want.text), key
        assert late[key].metrics.num_preemptions == want.metrics.num_preemptions, key
    strict_engine, strict = _run(hf_llama, tokenizer, params, late_readback="always", late_readback_strict=True,
                                 **settings)
    _same(strict, sync)
    assert late_engine.stats().num_late_steps > strict_engine.stats().num_late_steps > 0


def test_rows_that_need_their_token_on_the_host_are_read_at_once(hf_llama, tokenizer):
    """Penalties, n > 1 (before the fork) and a prefill-only request share steps with plain rows: those steps
    are read as soon as they are launched, the rest late; every output as the synchronous path gives it."""
    from jobrunner.engine.pooling import PoolingParams

    settings = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=64)
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=5, temperature=0.8, seed=3, n=2, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)]

    def run(**extra):
        engine = engine_from_hf(hf_llama, tokenizer, speculative="off", **settings, **extra)
        for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
            engine.add_request(f"r{i}", prompt, p)
        engine.add_request("embed", PROMPTS[5], PoolingParams(task="embed"))
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update({(o.request_id, o.sample_index): o for o in engine.step()})
            engine.check_integrity()
        return engine, outputs

    sync_engine, sync = run()
    late_engine, late = run(late_readback="always")
    assert late.keys() == sync.keys() and len(sync) == 6
    for key, want in sync.items():
        assert late[key].output_token_ids == want.output_token_ids, key
        assert late[key].pooled == want.pooled, key
    assert 0 < late_engine.stats().num_late_steps < late_engine.stats().steps


def test_modes_and_who_may_be_read_late():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not late_readback_on("off", cuda, False) and not late_readback_on("cuda", cpu, False)
    assert late_readback_on("cuda", cuda, False) and late_readback_on("always", cpu, False)
    assert not late_readback_on("always", cpu, True)                    # a speculator reads every step at once
    with pytest.raises(ValueError, match="late_readback"):
        EngineConfig(late_readback="later")
    plain = Request("a", [1, 2], SamplingParams(), 0.0)
    penalized = Request("b", [1, 2], SamplingParams(presence_penalty=0.5), 0.0)
    forking = Request("c", [1, 2], SamplingParams(n=2), 0.0)
    forking.siblings = [Request("c", [1, 2], SamplingParams(n=2), 0.0, sample_index=1)]
    assert can_read_late(plain) and not can_read_late(penalized) and not can_read_late(forking)


def test_patch_input_ids_takes_ids_left_on_the_device():
    ids = torch.tensor([5, 0, 7, 0, 9])
    patch_input_ids(ids, torch.tensor([-1, 2, -1, 0, -1]), torch.tensor([11, 12, 13]))
    assert ids.tolist() == [5, 13, 7, 11, 9]


def test_a_placeholder_without_its_step_is_refused(hf_llama, tokenizer):
    from jobrunner.engine.scheduler import ScheduledRequest

    engine = engine_from_hf(hf_llama, tokenizer)
    request = Request("a", [1, 2, 3], SamplingParams(), 0.0)
    request.output_token_ids = [4, PENDING_TOKEN]
    request.block_ids = [0]
    with pytest.raises(RuntimeError, match="still on the device"):
        engine.runner._layout([ScheduledRequest(request, 1, 4)], None)


def test_grammar_rows_are_read_at_once(hf_llama, tokenizer):
    """Structured output needs each token on the host before the next mask: while a grammar row runs, its steps
    are read at once; plain rows before and after it run late; every row's tokens as the synchronous path's."""
    require_import("xgrammar", "the [test] extra: structured output's grammar matcher")
    settings = dict(block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=1.0, seed=5, choice=["red fox", "blue dog", "green"]),
              SamplingParams(max_tokens=20, temperature=0.7, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)]
    prompts = PROMPTS[:4]
    want = engine_from_hf(hf_llama, tokenizer, speculative="off", **settings).generate(prompts, params)
    engine = engine_from_hf(hf_llama, tokenizer, speculative="off", late_readback="always", **settings)
    got = engine.generate(prompts, params)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    assert got[1].text in ("red fox", "blue dog", "green") and got[1].finish_reason == "stop"
    assert 0 < engine.stats().num_late_steps < engine.stats().steps


def test_a_request_preempted_before_its_stop_was_read_finishes_from_the_waiting_queue():
    from jobrunner.engine.kv_cache.manager import KVCacheManager
    from jobrunner.engine.request import RequestStatus
    from jobrunner.engine.scheduler import Scheduler

    kv = KVCacheManager(8, 4)
    scheduler = Scheduler(EngineConfig(max_num_seqs=2, num_kv_blocks=8), kv)
    request = Request("a", [1, 2, 3], SamplingParams(), 0.0)
    scheduler.add(request)
    scheduler.schedule()
    assert scheduler.running == [request] and request.block_ids
    scheduler._preempt(scheduler.running.pop(), scheduler.schedule())
    scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
    assert not scheduler.waiting and not scheduler.running and kv.pool.num_free_blocks == 8
