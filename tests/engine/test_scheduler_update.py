"""Scheduler.update_from_output on its own (no model): the runner's output is fixed token ids, as the scheduler's
two-call contract allows (schedule -> runner -> update_from_output)."""

from jobrunner.engine.config import EngineConfig
from jobrunner.engine.kv_cache.manager import KVCacheManager
from jobrunner.engine.readback import StepResult
from jobrunner.engine.request import Request, RequestStatus
from jobrunner.engine.sampling_params import SamplingParams
from jobrunner.engine.scheduler import Scheduler
from jobrunner.engine.stats import EngineStats


def _scheduler(tokenizer, stats: EngineStats) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4)
    return Scheduler(config, kv, tokenizer=tokenizer, max_model_len=32, stats=stats), kv


def _step(scheduler: Scheduler, sampled: dict, now: float):
    sched = scheduler.schedule()
    sched.advance()  # the runner launched it
    return sched, scheduler.update_from_output(sched, StepResult(sampled, {}, sched.num_tokens, 0), now)


def test_update_appends_tokens_stops_frees_blocks_and_stamps_the_outputs(tokenizer):
    stats = EngineStats()
    scheduler, kv = _scheduler(tokenizer, stats)
    eos = tokenizer.eos_token_id
    a = Request("a", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0), 0.0, (eos,))
    b = Request("b", [8, 9, 10, 11, 12], SamplingParams(max_tokens=5, temperature=0), 0.0, (eos,))
    scheduler.add(a)
    scheduler.add(b)

    sched, out = _step(scheduler, {a.key: 40, b.key: eos}, now=1.5)
    assert [s.request.request_id for s in sched.scheduled] == ["a", "b"]
    # b stopped on EOS: its output stamped with the step's time, its 2 blocks freed; a goes on with its token
    assert [(o.request_id, o.finish_reason, o.output_token_ids) for o in out] == [("b", "stop", [eos])]
    assert out[0].metrics.finish_time == 1.5 and out[0].metrics.first_token_time == 1.5
    assert a.output_token_ids == [40] and a.metrics.finish_time is None and scheduler.running == [a]
    assert b.block_ids == [] and kv.pool.num_used_blocks == 1  # a's 3 prompt tokens: one block of 4

    sched, out = _step(scheduler, {a.key: 41}, now=2.0)
    assert [(s.start, s.num_new_tokens) for s in sched.scheduled] == [(3, 1)]  # a's decode of token 40
    assert [(o.request_id, o.finish_reason, o.output_token_ids) for o in out] == [("a", "length", [40, 41])]
    assert out[0].text == tokenizer.decode([40, 41]) and out[0].metrics.token_times == [1.5, 2.0]
    assert not scheduler.running and not scheduler.waiting and kv.pool.num_used_blocks == 0
    assert stats.num_sampled_tokens == 3


def test_a_row_without_a_token_waits_and_a_row_that_ended_drops_its_token(tokenizer):
    stats = EngineStats()
    scheduler, _ = _scheduler(tokenizer, stats)
    a = Request("a", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0), 0.0)
    scheduler.add(a)
    sched = scheduler.schedule()
    sched.advance()
    # no token for a (e.g. a prompt chunk that does not reach its end): nothing changes
    assert scheduler.update_from_output(sched, StepResult({}, {}, 3, 0), 1.0) == []
    assert a.output_token_ids == [] and scheduler.running == [a]
    scheduler.finish(a, RequestStatus.FINISHED_STOPPED)  # ended meanwhile (late readback: by the step before)
    assert scheduler.update_from_output(sched, StepResult({a.key: 9}, {}, 3, 0), 2.0) == []
    assert a.output_token_ids == [] and stats.num_late_discarded_tokens == 1
