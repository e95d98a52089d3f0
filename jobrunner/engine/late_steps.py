"""The engine's step with one-step-late readback (engine/readback.py; docs/engine.md "One-step-late readback").

One call of :meth:`LateSteps.step`, with step N launched and unread:

1. if the running requests could run out of KV blocks, read step N first (a step that may preempt is then
   decided on the same state as the synchronous path); in strict mode also whenever a request waits to be
   admitted (else it is admitted a step later than the synchronous path would, into the room a row that ended
   at N leaves: the same tokens, but a prefix-cache hit can differ where blocks were evicted meanwhile);
2. schedule step N+1 — step N's rows count their token already: a placeholder ends each one's output, and a
   row whose length limit that token reaches is not scheduled (it ends whatever the token is);
3. launch step N+1 (its decode rows take step N's ids on the device) and set its rows' computed tokens;
4. read step N (the copy has run while the host did 2-3): placeholders give way to tokens, stops are checked,
   finished rows are freed and handed back; a row that stopped at N ran in N+1 for nothing and its token is
   dropped when N+1 is read (not read at all when every row of N+1 has ended);
5. hold step N+1 unread, its sampled rows ending in a placeholder — unless one of its rows must be read at once
   (:func:`~jobrunner.engine.readback.can_read_late`), then read it now.
"""

from __future__ import annotations

import time

from jobrunner.engine.readback import LaunchedStep, can_read_late
from jobrunner.engine.request import PENDING_TOKEN, RequestOutput
from jobrunner.engine.scheduler import SchedulerOutput


class LateSteps:
    """The launched, unread step of one engine and the loop around it (see the module docstring)."""

    def __init__(self, engine, strict: bool = False) -> None:
        self.engine = engine     # the LLMEngine whose scheduler, runner and outputs this loop drives
        self.strict = strict     # read first whenever a request waits to be admitted (see the module docstring)
        self.pending: tuple[SchedulerOutput, LaunchedStep] | None = None

    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of requests that finished in the step read by it."""
        engine = self.engine
        stats = engine.stats()
        finished: list[RequestOutput] = []
        scheduler = engine.scheduler
        if self.pending is not None and (scheduler.may_preempt() or (self.strict and scheduler.waiting)):
            finished += self.settle()
        t0 = time.perf_counter()
        sched = scheduler.schedule()
        if sched.is_empty:
            return finished + self.settle()
        t1 = time.perf_counter()
        previous = self.pending[1].device_tokens if self.pending is not None else None
        launched = engine.runner.launch(sched, previous)
        for s in sched.scheduled:
            s.request.num_computed_tokens = s.start + s.num_new_tokens
        finished += self.settle()
        if all(s.request.is_finished for s in sched.scheduled):  # every row ended at N: nothing left to read
            stats.num_late_discarded_tokens += len(launched.requests)
        elif all(can_read_late(s.request) for s in sched.scheduled):
            self._hold(sched, launched)
        else:
            finished += self._read(sched, launched)
        t2 = time.perf_counter()
        stats.schedule_s += t1 - t0
        stats.record_step(t2 - t1, launched.num_prefill_tokens, launched.num_decode_tokens)
        stats.num_fixed_shape_steps += launched.fixed_shape
        return finished

    def settle(self) -> list[RequestOutput]:
        """Read the held step, if any; the outputs of the requests it finished."""
        if self.pending is None:
            return []
        sched, launched = self.pending
        self.pending = None
        return self._read(sched, launched)

    def _read(self, sched: SchedulerOutput, launched: LaunchedStep) -> list[RequestOutput]:
        result = launched.read()
        return self.engine._apply_output(sched, result, time.perf_counter())

    def _hold(self, sched: SchedulerOutput, launched: LaunchedStep) -> None:
        """Leave ``launched`` unread: each of its sampled rows still running ends in a placeholder."""
        max_model_len = self.engine.max_model_len
        for s in sched.scheduled:
            request = s.request
            if not s.samples or request.is_finished:
                continue
            request.output_token_ids.append(PENDING_TOKEN)
            request.num_pending_tokens = 1
            # check_stop's length rule, which needs no token: such a row ends with it, so it waits unscheduled
            request.ends_with_pending = (request.num_output_tokens >= request.params.max_tokens
                                         or request.num_tokens >= max_model_len)
        self.pending = (sched, launched)
        self.engine.stats().num_late_steps += 1
