"""Draft-model speculation for one engine: which rows draft how far, then the draft model proposes.

The plan comes before the drafts (a draft model's drafts cost a forward pass per depth, so a row that will not
speculate must not be drafted). A plan drafting ``k_r`` tokens for row ``r`` (``K = max k_r``) costs, in
units of one target query token (``c1``): the target step ``r_t + X + sum k_r`` (``r_t = c0 / c1``, the fitted
fixed cost of :class:`~jobrunner.engine.speculative.policy.StepCost`) plus ``K`` draft steps,
``K * e0 / c1 + (e1 / c1) * sum k_r`` (the draft's own step line ``e0 + e1 * tokens``, fitted on its own
steps; before it has run, ``e1 / c1`` = the draft's share of the weight bytes and ``e0 / e1`` = the target's
``r_t``). It yields ``D + sum_r sum_{i <= k_r} alpha ** i`` tokens (``alpha``: the measured acceptance of
this draft model, :class:`~jobrunner.engine.speculative.policy.Acceptance` under match length 0, with an
optimistic prior, 0.9 worth 8 verified tokens, and one row per step drafting until 8 were verified: a draft is
measured only when it runs, and its first run on a row prefills that row's whole prompt). For each
depth cap ``K`` :func:`~jobrunner.engine.speculative.policy.plan_drafts` picks the draft tokens (costs scaled
so one draft token costs ``1 + e1 / c1``); the best plan is kept if its tokens per cost beat not speculating
by the policy's margin. So drafts run at batch 1 when the draft is cheap and accepted, and stop at full batch.
With waiting requests and room in the batch nothing is drafted (as ``auto``). ``draft_every_step`` (tests,
benchmarks) drafts ``num_speculative_tokens`` for every decoding row.
"""

from __future__ import annotations

from dataclasses import replace

from jobrunner.engine.speculative import Speculator
from jobrunner.engine.speculative.draft_model import DraftModel
from jobrunner.engine.speculative.draft_proposer import DraftProposer
from jobrunner.engine.speculative.policy import MARGIN, StepCost, plan_drafts
from jobrunner.engine.speculative.verify import VerifiedDraft

DRAFT_BUCKET = 0  # the Acceptance length of draft-model drafts (n-gram drafts use their match length, >= 1)
DRAFT_KEY = (DRAFT_BUCKET, True)  # one pooled per-token rate: every draft token is counted under this key
# A draft model's acceptance starts optimistic (this prior, worth PROBE_TOKENS verified draft tokens): a draft
# is only measured when it runs, and the policy's neutral prior (0.5) would never let a draft run. While fewer
# than PROBE_TOKENS were verified, only one row per step drafts (its first run prefills that row's prompt).
PROBE_TOKENS, PROBE_ACCEPTANCE = 8, 0.9


class DraftSpeculator(Speculator):
    """Plans draft lengths, runs the draft model (:class:`DraftProposer`) and accounts its acceptance."""

    def __init__(self, draft: DraftModel, proposer: DraftProposer, num_tokens: int, max_num_seqs: int,
                 max_model_len: int, device_type: str, every_step: bool, weight_ratio: float) -> None:
        super().__init__("draft", num_tokens, max_num_seqs, max_model_len, device_type)
        self.draft = draft
        self.proposer = proposer
        self.every_step = every_step
        self.weight_ratio = weight_ratio
        self.draft_cost = StepCost(self.cost.prior)
        self.draft_max_len = min(max_model_len, draft.model.rotary.max_positions)

    @classmethod
    def for_engine(cls, engine, num_blocks: int) -> DraftSpeculator:
        """The speculator of ``engine`` (an LLMEngine whose ``draft`` is loaded), its draft KV ``num_blocks``."""
        cfg, draft = engine.config, engine.draft
        max_len = min(engine.max_model_len, draft.model.rotary.max_positions)
        # the draft's cache in its own dtype, the plain split of decode work; its drafts need no batch invariance
        draft_cfg = replace(cfg, kv_cache_dtype="auto", split_decode="off", deterministic=False)
        proposer = DraftProposer(draft.model, draft_cfg, num_blocks, engine.device, max_len,
                                 engine._decode_graphs_mode())
        engine.model_info["draft_kv_bytes"] = num_blocks * draft.kv_bytes_per_block(cfg.block_size)
        ratio = draft.weight_bytes / max(1, engine.model_info.get("weight_bytes") or draft.weight_bytes)
        return cls(draft, proposer, cfg.num_speculative_tokens, cfg.max_num_seqs, engine.max_model_len,
                   engine.device.type, cfg.draft_every_step, ratio)

    def propose(self, running: list, num_waiting: int) -> None:
        """Set ``draft_token_ids`` on every running request (empty where it should not speculate)."""
        self.proposer.release_missing(running)
        rows, limits = [], []
        for request in running:
            request.draft_token_ids = []
            limit = min(self.k, request.params.max_tokens - request.num_output_tokens - 1,
                        self.max_model_len - request.num_tokens - 1, self.draft_max_len - request.num_tokens)
            if self._decoding(request) and limit >= 1:
                rows.append(request)
                limits.append(limit)
        ks = limits if self.every_step else self._plan_rows(limits, len(running), num_waiting)
        picked = [(r, k) for r, k in zip(rows, ks) if k]
        if not picked:
            return
        seen = len(self.proposer.step_times)
        drafts = self.proposer.propose([r for r, _ in picked], [k for _, k in picked])
        for tokens, seconds in self.proposer.step_times[seen:]:
            self.draft_cost.observe(tokens, seconds)
        del self.proposer.step_times[:]
        for (request, _), draft in zip(picked, drafts):
            request.draft_token_ids = list(draft)

    def _plan_rows(self, limits: list[int], num_running: int, num_waiting: int) -> list[int]:
        if not limits or (num_waiting and num_running < self.max_num_seqs):
            return [0] * len(limits)
        ks = plan_with_draft(self.alpha(), limits, num_running, num_running, *self.relative_costs())
        if self.is_probing and any(ks):  # one row measures the draft: its first run prefills only that row
            first = next(i for i, k in enumerate(ks) if k)
            ks = [k if i == first else 0 for i, k in enumerate(ks)]
        return ks

    @property
    def is_probing(self) -> bool:
        return self.acceptance.evaluated.get(DRAFT_KEY, 0.0) < PROBE_TOKENS

    def alpha(self) -> float:
        """The measured acceptance under an optimistic prior worth :data:`PROBE_TOKENS` verified tokens."""
        a = self.acceptance
        return ((a.accepted.get(DRAFT_KEY, 0.0) + PROBE_TOKENS * PROBE_ACCEPTANCE)
                / (a.evaluated.get(DRAFT_KEY, 0.0) + PROBE_TOKENS))

    def relative_costs(self) -> tuple[float, float, float]:
        """``(r_t, e0 / c1, e1 / c1)``: the target's fixed cost and the draft step's, in target query tokens."""
        r_t = self.cost.fixed_tokens()
        c1 = _slope(self.cost.points, r_t)
        r_d = self.draft_cost.fixed_tokens()
        e1 = _slope(self.draft_cost.points, r_d)
        per_token = e1 / c1 if c1 and e1 else self.weight_ratio
        return r_t, per_token * r_d, per_token

    def record(self, request, verified: VerifiedDraft) -> None:
        """Account one verified draft and keep the draft's K/V of the accepted tokens."""
        super().record(request, verified)  # the request's counters
        m, k = verified.num_accepted, verified.num_drafted
        self.acceptance.record(DRAFT_BUCKET, True, m + (m < k), m)
        self.proposer.accept(request, m)

    def settle(self, running: list) -> None:
        """After a step: finished and preempted requests give their draft KV back."""
        self.proposer.release_missing(running)

    def stats(self) -> dict:
        r_t, e0, e1 = self.relative_costs()
        return {**super().stats(), "draft_source": self.draft.source, "draft_steps": self.proposer.num_steps,
                "draft_s": round(self.proposer.seconds, 3), "draft_step_fixed_tokens": round(e0, 3),
                "draft_token_cost": round(e1, 4), "draft_kv_blocks_used": self.proposer.num_used_blocks}


def _slope(points, fixed_tokens: float) -> float | None:
    """``c1`` of a step line ``c1 * (fixed_tokens + tokens)`` through the mean of ``points`` (None: no points)."""
    if not points:
        return None
    return sum(s / (fixed_tokens + x) for x, s in points) / len(points)


def plan_with_draft(alpha: float, lengths: list[int], num_decoding: int, num_tokens: int, fixed_tokens: float,
                    draft_step_tokens: float, draft_token_cost: float) -> list[int]:
    """Draft tokens per row (0 = none) that maximise expected tokens per cost, or all 0 when no plan beats not
    speculating by the policy's margin (costs in target query tokens; see the module docstring)."""
    unit = 1.0 + draft_token_cost
    base = num_decoding / (fixed_tokens + num_tokens)
    best, best_rate = [0] * len(lengths), base * (1.0 + MARGIN)
    for cap in range(1, max(lengths, default=0) + 1):
        fixed = fixed_tokens + cap * draft_step_tokens
        ks = plan_drafts([(alpha, alpha)] * len(lengths), [min(n, cap) for n in lengths], num_decoding,
                         num_tokens / unit, fixed / unit)
        if not any(ks):
            continue
        expected = num_decoding + sum(sum(alpha ** i for i in range(1, k + 1)) for k in ks)
        cost = fixed_tokens + num_tokens + unit * sum(ks) + max(ks) * draft_step_tokens
        if expected / cost > best_rate:
            best, best_rate = ks, expected / cost
    return best
