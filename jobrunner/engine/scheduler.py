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
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from jobrunner.engine.config import EngineConfig
from jobrunner.engine.kv_cache.manager import KVCacheManager
from jobrunner.engine.long_rope import LongRopeSwitch
from jobrunner.engine.pooling import PoolingState
from jobrunner.engine.request import Request, RequestStatus


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


class Scheduler:
    """Owns the waiting and running queues and the KV cache manager."""

    def __init__(self, config: EngineConfig, kv_manager: KVCacheManager,
                 long_rope: LongRopeSwitch | None = None) -> None:
        self.config = config
        self.kv = kv_manager
        self.long_rope = long_rope
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

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
