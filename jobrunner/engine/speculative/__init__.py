"""Speculative decoding: n-gram (prompt lookup) drafts, verified in one step through the paged KV cache.

Per step, before scheduling, :class:`Speculator` proposes drafts for the running requests that are decoding
(:mod:`.ngram`) and, in ``auto`` mode, keeps only the draft tokens the cost model says pay
(:mod:`.policy`); it sets ``request.draft_token_ids``. The scheduler gives such a request ``1 + k`` query
tokens (its KV slots allocated as lookahead, never registered in the prefix cache), the model runner scores
them causally like a small prompt chunk, and :mod:`.verify` keeps the drafts the target model agrees with.
The engine then appends the accepted tokens, and trims the blocks that only held rejected drafts.

``speculative`` set to a model source runs a small draft model on the same tokenizer as the proposer instead
(:mod:`.draft_model` loads and checks it, :mod:`.draft_proposer` runs it over its own paged KV cache,
:mod:`.draft_speculator` plans its draft lengths); verification is the same.

In ``auto`` mode acceptance is measured on every decode step, speculating or not: a proposal that was not
verified is compared with the tokens the request goes on to generate (a *shadow* draft).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jobrunner.engine.speculative.ngram import NgramIndex
from jobrunner.engine.speculative.policy import PRIOR_FIXED_TOKENS, Acceptance, StepCost, plan_drafts
from jobrunner.engine.speculative.verify import VerifiedDraft

MAX_NGRAM, MIN_NGRAM = 3, 1


@dataclass
class DraftState:
    """A request's n-gram index, the n of its current draft, and a shadow draft being checked."""

    index: NgramIndex
    draft_n: int = 0
    shadow: list[int] = field(default_factory=list)
    shadow_n: int = 0
    shadow_at: int = 0  # output position the shadow's first token predicts
    shadow_first: bool = True  # the shadow's next token to check is its first


class Speculator:
    """Proposes, plans and accounts drafts for one engine (``mode``: ``ngram`` or ``auto``)."""

    def __init__(self, mode: str, num_tokens: int, max_num_seqs: int, max_model_len: int,
                 device_type: str = "cpu") -> None:
        self.mode = mode
        self.k = num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.acceptance = Acceptance()
        self.cost = StepCost(PRIOR_FIXED_TOKENS.get(device_type, PRIOR_FIXED_TOKENS["cuda"]))

    def propose(self, running: list, num_waiting: int) -> None:
        """Set ``draft_token_ids`` on every running request (empty where it should not speculate)."""
        rows, drafts = [], []
        for request in running:
            request.draft_token_ids = []
            if not self._decoding(request):
                continue
            state = request.spec or DraftState(NgramIndex(MAX_NGRAM, MIN_NGRAM))
            request.spec = state
            self._settle_shadow(request, state)
            limit = min(self.k, request.params.max_tokens - request.num_output_tokens - 1,
                        self.max_model_len - request.num_tokens - 1)
            if limit < 1:
                continue
            draft, n = state.index.propose(request.all_token_ids, limit)
            if draft:
                rows.append(request)
                drafts.append((draft, n))
        if not rows:
            return
        ks = self._plan(rows, drafts, len(running), num_waiting)
        for request, (draft, n), k in zip(rows, drafts, ks):
            state = request.spec
            if k:
                request.draft_token_ids, state.draft_n = draft[:k], n
                state.shadow = []
            elif not state.shadow:  # measure this proposal against what the request generates next
                state.shadow, state.shadow_n, state.shadow_at = draft, n, request.num_output_tokens
                state.shadow_first = True

    def _plan(self, rows: list, drafts: list, num_running: int, num_waiting: int) -> list[int]:
        if self.mode == "ngram":
            return [len(d) for d, _ in drafts]
        if num_waiting and num_running < self.max_num_seqs:
            return [0] * len(rows)  # the batch is about to grow: leave the step to the new prompts
        alphas = [self.acceptance.alpha(n) for _, n in drafts]
        return plan_drafts(alphas, [len(d) for d, _ in drafts], num_running, num_running,
                           self.cost.fixed_tokens(num_running))

    def _decoding(self, request) -> bool:
        """Past its prompt with exactly one token to compute, and no grammar (drafts would bypass its mask)."""
        return (request.num_output_tokens >= 1 and request.grammar is None
                and request.num_computed_tokens == request.num_tokens - 1)

    def _settle_shadow(self, request, state: DraftState) -> None:
        """Compare a shadow draft with the tokens generated since it was made; record what matched."""
        out = request.output_token_ids
        while state.shadow and state.shadow_at < len(out):
            hit = out[state.shadow_at] == state.shadow[0]
            self.acceptance.record(state.shadow_n, state.shadow_first, 1, int(hit))
            if not hit:
                state.shadow = []
                break
            state.shadow, state.shadow_at, state.shadow_first = state.shadow[1:], state.shadow_at + 1, False

    def record(self, request, verified: VerifiedDraft) -> None:
        """Account one verified draft (acceptance per n-gram length, the request's metrics)."""
        m, k = verified.num_accepted, verified.num_drafted
        if request.spec is not None:
            self.acceptance.record_draft(request.spec.draft_n, k, m)
        request.metrics.num_draft_tokens += k
        request.metrics.num_accepted_tokens += m

    def settle(self, running: list) -> None:
        """After a step: forget the state of requests no longer running (a draft model's KV; n-gram: none)."""

    def observe_step(self, num_prefill_tokens: int, num_decode_tokens: int, seconds: float) -> None:
        """Time a decode-only step (the cost model's data)."""
        if num_prefill_tokens == 0 and num_decode_tokens:
            self.cost.observe(num_decode_tokens, seconds)

    def stats(self) -> dict:
        """The policy's current view: acceptance (first, later draft token) per n-gram length and the fitted
        fixed cost in tokens at a few step sizes."""
        sizes = sorted({1, 8, self.max_num_seqs})
        return {"mode": self.mode, "fixed_tokens": {x: round(self.cost.fixed_tokens(x), 2) for x in sizes},
                "alpha": {n: [round(a, 3) for a in self.acceptance.alpha(n)] for n in self.acceptance.lengths()}}


def make_speculator(mode: str, num_tokens: int, max_num_seqs: int, max_model_len: int,
                    device_type: str, engine=None, num_kv_blocks: int = 0) -> Speculator | None:
    """The engine's speculator for ``EngineConfig.speculative`` (None when ``off``); a draft-model one when
    ``engine.draft`` is loaded (its KV: ``num_kv_blocks`` blocks)."""
    if mode == "off":
        return None
    if getattr(engine, "draft", None) is not None:
        from jobrunner.engine.speculative.draft_speculator import DraftSpeculator

        return DraftSpeculator.for_engine(engine, num_kv_blocks)
    return Speculator(mode, num_tokens, max_num_seqs, max_model_len, device_type)
