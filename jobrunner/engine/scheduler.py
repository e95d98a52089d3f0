"""Iteration-level (continuous) batching.

There is no prefill phase and no decode phase. Each request has ``num_computed_tokens`` and ``num_tokens``
(prompt + generated so far); every step the scheduler hands out tokens so that computed catches up with
total, within ``max_num_batched_tokens`` tokens and ``max_num_seqs`` requests. Running requests go first
(a decode costs one token; an unfinished prompt gets a chunk), then waiting requests are admitted in
arrival order while budget and KV blocks last. A prefix-cache hit simply starts a request with
``num_computed_tokens > 0``; chunked prefill is the same rule spread over several steps. When KV blocks run
out for a running request, the newest running request is preempted: its blocks are freed and it goes back
to the front of the waiting queue, to be recomputed later (its generated tokens are kept, so recomputing
reproduces the same state). A request that can never fit is rejected when it is added (see LLMEngine).
Samples 1..n-1 of an n > 1 request join at the front of the waiting queue once sample 0's prompt is computed,
already holding references on its full prompt blocks (``add_forked``), so they start past them.
A longrope model's request that grows past the rope threshold is recomputed on the long table through the same
path as a preemption (``long_rope``; see jobrunner/engine/long_rope.py).

After each step, :meth:`Scheduler.update_from_output` takes the step's sampled tokens: it appends them, checks
stops, frees the blocks of what finished and returns the finished requests' outputs, stamped with the time.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jobrunner.engine.config import EngineConfig
from jobrunner.engine.kv_cache.manager import KVCacheManager
from jobrunner.engine.long_rope import LongRopeSwitch
from jobrunner.engine.pooling import PoolingState
from jobrunner.engine.request import PENDING_TOKEN, Request, RequestOutput, RequestStatus
from jobrunner.engine.sampling.logprobs import LogprobEntry, TokenTexts
from jobrunner.engine.stats import EngineStats
from jobrunner.engine.stopping import check_stop, finished_output

if TYPE_CHECKING:
    from jobrunner.engine.readback import StepResult


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start: int  # num_computed_tokens before this step
    draft: list[int] = field(default_factory=list)  # speculative tokens verified after the new ones

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the request's known tokens (so a new token is sampled); never
        for a prefill-only request (engine/pooling.py), which finishes there instead."""
        return self.request.pooling is None and self.completes

    @property
    def completes(self) -> bool:
        """Whether this step computes the request's last known token."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + len(s.draft) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def advance(self) -> None:
        """Once the step is launched: each row's computed tokens take in this step's (drafts: once verified)."""
        for s in self.scheduled:
            s.request.num_computed_tokens = s.start + s.num_new_tokens


class Scheduler:
    """Owns the waiting and running queues and the KV cache manager; takes each step's output.

    ``tokenizer`` (stop strings, output text, logprob entries' texts), ``max_model_len`` (the length stop) and
    ``stats`` (the engine's counters) serve :meth:`update_from_output`; a scheduler that only schedules (the
    memory profile's) needs none of them.
    """

    def __init__(self, config: EngineConfig, kv_manager: KVCacheManager, long_rope: LongRopeSwitch | None = None,
                 *, tokenizer=None, max_model_len: int = 0, stats: EngineStats | None = None) -> None:
        self.config = config
        self.kv = kv_manager
        self.long_rope = long_rope
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)
        self.max_model_len = max_model_len
        self.stats = stats if stats is not None else EngineStats()

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_forked(self, requests: list[Request]) -> None:
        """Queue forked samples first: they already hold their shared prompt blocks."""
        self.waiting.extendleft(reversed(requests))

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.ends_with_pending:  # late readback: it stops at the token on its way, nothing to compute
                i += 1
                continue
            if self.long_rope is not None and self.long_rope.must_recompute(request):
                self._recompute(self.running.pop(i))  # admitted again below, on the long table
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            draft = request.draft_token_ids[:budget - num_new] if num_new == 1 else []
            if draft and self.long_rope is not None:
                draft = draft[:self.long_rope.max_draft(request)]
            if draft and not self.kv.allocate_slots(request, num_new, num_lookahead_tokens=len(draft)):
                draft = []  # no room for the drafts: a plain decode (which may still preempt)
            while not draft and not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()  # the newest running request
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, num_new, request.num_computed_tokens, draft))
                budget -= num_new + len(draft)
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        now = time.perf_counter()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if self.long_rope is not None:
                self.long_rope.assign(request)  # a forked sample's table is its shared blocks' (same length)
            if request.block_ids:  # a forked sample: it holds its shared prompt blocks already
                cached, num_cached_tokens = [], request.num_computed_tokens
            else:
                cached = self.kv.find_cached_prefix(request)
                num_cached_tokens = len(cached) * self.kv.block_size
            num_new = min(request.num_tokens - num_cached_tokens, budget)
            if not self.kv.allocate_slots(request, num_new, cached):
                break
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING:
                request.metrics.num_cached_tokens = num_cached_tokens
                request.metrics.first_scheduled_time = now
            request.num_computed_tokens = num_cached_tokens
            if request.pooling is not None:  # (re)computed from here: nothing kept from an earlier admission
                request.pool_state = PoolingState()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new, num_cached_tokens))
            budget -= num_new

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.metrics.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)
        out.scheduled = [s for s in out.scheduled if s.request is not request]

    def _recompute(self, request: Request) -> None:
        """Drop a running request's KV and queue it first, to be computed again from its first token."""
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished and release its blocks (it must be running, or preempted with a token read late)."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        else:  # late readback: preempted while the token that stops it was still on the device
            self.waiting.remove(request)
        self.kv.free(request)

    def may_preempt(self) -> bool:
        """Whether the running requests could need more blocks than are free to compute every token they hold
        (then a step might preempt: late readback reads the last step first, as the synchronous path would)."""
        need = sum(max(0, self.kv.num_blocks_for(r.num_tokens) - len(r.block_ids)) for r in self.running)
        return need > self.kv.pool.num_free_blocks

    # -- after a step ----------------------------------------------------------------------------------------

    def update_from_output(self, sched: SchedulerOutput, result: StepResult, now: float) -> list[RequestOutput]:
        """Append each row's sampled token(s), check stops, finish what ended (a prefill-only row: with its
        pooled result); the outputs of the requests that finished, stamped ``now``.

        A step read one step late (engine/readback.py) may hold rows that ended with the step before: their
        token is dropped; a row's placeholder (its token was on the device) gives way to the token here."""
        finished = []
        for s in sched.scheduled:
            request = s.request
            if request.is_finished:  # late readback: it ended with the previous step's token
                self.stats.num_late_discarded_tokens += request.key in result.sampled
            elif request.pooling is not None:
                if s.completes:
                    finished.append(self._finish_pooling(request, result.pooled[request.key], now))
            elif request.key in result.sampled:
                out = self._take_output(s, result, now)
                if out is not None:
                    finished.append(out)
        return finished

    def _take_output(self, s: ScheduledRequest, result: StepResult, now: float) -> RequestOutput | None:
        """One sampling row's token(s) (a verified draft's accepted ones and the next); its output if it ended."""
        request = s.request
        read_late = request.num_pending_tokens > 0
        if read_late:
            request.output_token_ids.pop()   # the placeholder (PENDING_TOKEN)
            request.num_pending_tokens, request.ends_with_pending = 0, False
        verified = result.speculative.get(request.key) if result.speculative else None
        if verified is not None:  # accepted drafts keep their KV; the rest is trimmed below
            request.num_computed_tokens += verified.num_accepted
            tokens, entries = verified.tokens, verified.logprobs
        else:
            tokens, entries = [result.sampled[request.key]], [result.logprobs.get(request.key)]
        for token, entry in zip(tokens, entries):
            status = self._take_token(request, token, entry, now)
            if status is not None:
                self.finish(request, status)
                return finished_output(request, self.tokenizer, now)
        if s.draft:
            self.kv.trim(request, request.num_tokens)
        if read_late:  # as the synchronous path registers it when the next step is scheduled
            self.kv.register_computed(request)
        return None

    def _take_token(self, request: Request, token: int, entry: LogprobEntry | None, now: float
                    ) -> RequestStatus | None:
        """Append one sampled token; the request's finished status, or None to keep going."""
        request.output_token_ids.append(token)
        self.stats.num_sampled_tokens += 1
        if entry is not None:
            request.logprobs.append(self.token_texts.entry(entry))
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        request.metrics.token_times.append(now)
        accepted = request.grammar is None or request.grammar.accept(token)
        if request.siblings:  # the prompt is computed: start the other samples on its KV blocks
            self._fork_siblings(request)
        if not accepted:  # never hand back output that breaks its grammar
            request.error = f"token {token} broke the output grammar"
            return RequestStatus.FINISHED_ERROR
        return check_stop(request, token, self.max_model_len, self.tokenizer)

    def _fork_siblings(self, request: Request) -> None:
        """Samples 1..n-1 take references on sample 0's full prompt blocks and queue (see docs/engine.md)."""
        shared = self.kv.fork(request, request.num_prompt_tokens)
        for sibling in request.siblings:
            self.kv.adopt(sibling, shared)
            sibling.metrics.prompt_shared = True
        self.add_forked(request.siblings)
        self.stats.num_forked_samples += len(request.siblings)
        self.stats.num_shared_prompt_tokens += len(request.siblings) * len(shared) * self.kv.block_size
        request.siblings = []

    def _finish_pooling(self, request: Request, pooled, now: float) -> RequestOutput:
        """A prefill-only request's tokens are all computed: its result (or why there is none), blocks freed."""
        status = RequestStatus.FINISHED_STOPPED
        if isinstance(pooled, str):
            status, request.error = RequestStatus.FINISHED_ERROR, pooled
        else:
            request.pooled = pooled
        request.metrics.first_token_time = now  # its result is ready: time to first result
        self.finish(request, status)
        return finished_output(request, self.tokenizer, now)

    def hold(self, sched: SchedulerOutput) -> None:
        """Late readback: ``sched`` stays unread a step, so each of its sampled rows still running ends in a
        placeholder, and one whose length limit that token reaches waits unscheduled (it ends with it)."""
        for s in sched.scheduled:
            request = s.request
            if not s.samples or request.is_finished:
                continue
            request.output_token_ids.append(PENDING_TOKEN)
            request.num_pending_tokens = 1
            # check_stop's length rule, which needs no token
            request.ends_with_pending = (request.num_output_tokens >= request.params.max_tokens
                                         or request.num_tokens >= self.max_model_len)
