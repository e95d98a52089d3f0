"""The draft model's own paged KV cache and runner: k autoregressive greedy steps for the rows that speculate.

Each speculating request has a :class:`DraftSeq` in the draft's KV (its own :class:`KVCacheManager` over its own
block pool, its own :class:`ModelRunner`): ``num_computed_tokens`` tokens of the request whose K/V the draft
holds. A proposal of ``k`` tokens for a request of ``L`` known tokens:

1. catch up: the draft computes tokens ``num_computed_tokens .. L-1`` (the whole prompt the first time, else the
   one or two tokens the target added since: the bonus token, the last draft) and samples ``d_0``; long
   catch-ups are cut into chunks of ``max_num_batched_tokens``;
2. ``k - 1`` single-token steps feed ``d_0 .. d_{k-2}`` (written into lookahead slots, never registered in the
   draft's prefix cache) and sample ``d_1 .. d_{k-1}``.

Every step runs all speculating rows together. After verification (``accept``) the draft keeps the K/V of the
accepted drafts it has (``L + min(m, k - 1)`` tokens); the K/V past it is stale and simply overwritten by the
next catch-up. A request that stops running (finished, preempted) loses its draft blocks (``release_missing``);
a request that does not speculate for a while costs nothing and catches up in one chunked prefill when it
speculates again. Drafts are greedy: verification accepts ``d`` when the target's own (seeded) draw equals it,
which is exact for any proposer (``verify.py``).
"""

from __future__ import annotations

import time

import torch

from jobrunner.engine.config import EngineConfig
from jobrunner.engine.kv_cache.manager import KVCacheManager
from jobrunner.engine.model_runner import ModelRunner
from jobrunner.engine.sampling_params import SamplingParams
from jobrunner.engine.scheduler import ScheduledRequest, SchedulerOutput

GREEDY = SamplingParams(temperature=0.0)


class DraftSeq:
    """A request as the draft's runner and KV manager see it: its tokens, then the drafts made so far; the
    draft's own blocks. ``known``: the request's tokens when the current drafts were made."""

    params = GREEDY
    seed = 0
    grammar = None
    eos_token_ids: tuple[int, ...] = ()
    rope_table = 0  # the draft model's first rope table, always (longrope's long one would only change proposals)
    adapter_id = 0  # the draft model runs without LoRA adapters: its cached blocks are the base model's
    pooling = None  # drafts are generated tokens, never a prefill-only (embed / score) request
    num_pending_tokens = 0  # every token is known on the host (late readback never runs with a speculator)
    images = None  # a draft model sees no images (its blocks are keyed by tokens alone: kv_cache/manager.py)

    def __init__(self, request) -> None:
        self.request = request
        self.key = request.key
        self.drafts: list[int] = []
        self.known = 0
        self.block_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_blocks = 0
        self.block_hashes: list[int] = []

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.drafts

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.all_token_ids + self.drafts

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.drafts)

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens + len(self.drafts)

    @property
    def first_needed_position(self) -> int:
        """A prefix-cache hit of the draft may cover every token but the last (drafts are generated)."""
        return self.num_tokens - 1


class DraftProposer:
    """Owns the draft's KV blocks and runner; proposes greedy drafts for a batch of requests."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, num_blocks: int, device: torch.device,
                 max_model_len: int, decode_graphs: str = "off") -> None:
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.runner = ModelRunner(model, config, num_blocks, device, max_model_len, decode_graphs)
        self.max_num_tokens = config.max_num_batched_tokens
        self.seqs: dict[tuple[str, int], DraftSeq] = {}
        self.step_times: list[tuple[int, float]] = []  # (tokens, seconds) of decode-like steps: the cost model
        self.num_steps = 0
        self.seconds = 0.0

    def propose(self, requests: list, ks: list[int]) -> list[list[int]]:
        """Up to ``ks[i]`` greedy draft tokens after each request's tokens (``[]`` where its blocks found no
        room even after dropping the draft KV of requests not drafting now)."""
        ready = [(self._seq(r), k) for r, k in zip(requests, ks)]
        ready = self._allocate(ready, {r.key for r in requests})
        self._catch_up([seq for seq, _ in ready])
        for depth in range(1, max((k for _, k in ready), default=0)):
            rows = [seq for seq, k in ready if k > depth]
            result = self._execute([ScheduledRequest(seq, 1, seq.known + depth - 1) for seq in rows])
            for seq in rows:
                seq.drafts.append(result.sampled[seq.key])
        return [self.seqs[r.key].drafts if r.key in self.seqs else [] for r in requests]

    def accept(self, request, num_accepted: int) -> None:
        """The target accepted ``num_accepted`` drafts: the draft's K/V of those it fed stays valid."""
        seq = self.seqs.get(request.key)
        if seq is not None and seq.drafts:
            seq.num_computed_tokens = seq.known + min(num_accepted, len(seq.drafts) - 1)
            seq.drafts = []

    def release_missing(self, running: list) -> None:
        """Drop the draft state of every request that is no longer running (finished or preempted)."""
        live = {r.key for r in running}
        for key in [k for k in self.seqs if k not in live]:
            self.release(key)

    def release(self, key) -> None:
        seq = self.seqs.pop(key)
        self.kv.free(seq)
        self.runner.release(key)

    @property
    def num_used_blocks(self) -> int:
        return self.kv.pool.num_used_blocks

    # -- steps -------------------------------------------------------------------------------------------------

    def _seq(self, request) -> DraftSeq:
        seq = self.seqs.get(request.key)
        if seq is None:
            seq = self.seqs[request.key] = DraftSeq(request)
        seq.drafts, seq.known = [], request.num_tokens
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.known - 1)  # at least one token to feed
        return seq

    def _allocate(self, ready: list[tuple[DraftSeq, int]], drafting: set) -> list[tuple[DraftSeq, int]]:
        """Blocks for each row's catch-up and its ``k - 1`` fed drafts; rows that find no room are left out."""
        kept = []
        for seq, k in ready:
            if not self._allocate_one(seq, k):
                for key in [key for key in self.seqs if key not in drafting]:
                    self.release(key)  # the idle rows' draft KV: recomputed when they draft again
                if not self._allocate_one(seq, k):
                    continue
            kept.append((seq, k))
        return kept

    def _allocate_one(self, seq: DraftSeq, k: int) -> bool:
        cached = self.kv.find_cached_prefix(seq) if not seq.block_ids else []
        num_new = seq.known - seq.num_computed_tokens - len(cached) * self.kv.block_size
        if not self.kv.allocate_slots(seq, num_new, cached, num_lookahead_tokens=k - 1):
            return False
        seq.num_computed_tokens += len(cached) * self.kv.block_size
        return True

    def _catch_up(self, seqs: list[DraftSeq]) -> None:
        """Compute every row's missing known tokens (chunks within the token budget); sample ``d_0``."""
        pending = seqs
        while pending:
            budget, scheduled = self.max_num_tokens, []
            for seq in pending:
                if budget <= 0:
                    break
                n = min(seq.known - seq.num_computed_tokens, budget)
                scheduled.append(ScheduledRequest(seq, n, seq.num_computed_tokens))
                budget -= n
            result = self._execute(scheduled)
            for s in scheduled:
                s.request.num_computed_tokens += s.num_new_tokens
                token = result.sampled.get(s.request.key)
                if token is not None:
                    s.request.drafts.append(token)
            pending = [seq for seq in pending if seq.num_computed_tokens < seq.known]

    def _execute(self, scheduled: list[ScheduledRequest]):
        t0 = time.perf_counter()
        result = self.runner.execute(SchedulerOutput(scheduled))  # its tokens come back to the host: synced
        seconds = time.perf_counter() - t0
        num_tokens = sum(s.num_new_tokens for s in scheduled)
        if num_tokens <= 2 * len(scheduled):  # decode-like steps only: a prompt's catch-up is a prefill
            self.step_times.append((num_tokens, seconds))
        self.num_steps += 1
        self.seconds += seconds
        return result
