"""Turn the last-position logits of each sampling request into its next token, vectorised over the batch.

Order per step: log-probabilities of the raw logits (if any row asks), then logits processors (logit bias,
min_tokens, penalties; :mod:`jobrunner.engine.sampling.penalties`), then grammar masks (structured output),
then greedy rows take the argmax and the others go through temperature, min-p, top-k, top-p and a Gumbel-max
draw whose noise is a hash of (row seed, output position, token id) (:mod:`jobrunner.engine.sampling.noise`):
no generator objects, no per-row launches, and a row's text depends only on its own seed. Everything the
host needs (tokens, and logprobs when asked) comes back in one device->host transfer: at once
(:meth:`Sampler.sample`), or one step late (:meth:`Sampler.sample_on_device`, engine/readback.py).

A call whose rows are all plain greedy (:func:`plain_greedy`: nothing reads float32 logits) on CPU skips the
float32 copy: the native row argmax (:mod:`jobrunner.engine.sampling.argmax`) runs on the model's float32 or
bf16 logits, the same indices (bf16 widens to float32 exactly; the argmax is exact, so deterministic mode is
unaffected). ``JOBRUNNER_NATIVE_ARGMAX=0``, another device or a missing compiler keep the float32 path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jobrunner.engine.request import Request
from jobrunner.engine.sampling import filters, penalties, row_argmax, to_device
from jobrunner.engine.sampling.argmax import native_row_argmax
from jobrunner.engine.sampling.grammar_masks import DeviceGrammarMasks
from jobrunner.engine.sampling.logprobs import LogprobEntry, gather_logprobs, unpack
from jobrunner.engine.sampling.noise import keys_tensor, row_key
from jobrunner.engine.sampling.token_counts import DevicePenaltyState


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[LogprobEntry | None]   # per row; None where the request did not ask


@dataclass
class DeviceSample:
    """One call's picks before the host reads them: what :func:`host_output` turns into a SamplerOutput."""

    tokens: torch.Tensor                # [N] int64, on the logits' device
    packed: torch.Tensor | None = None  # [N, 2 + 2 k_max] float64 (token, logprob, top-k), when a row asked
    k_max: int | None = None

    def host_tensor(self) -> torch.Tensor:
        """The one tensor the host needs (``packed`` when logprobs were asked, else ``tokens``)."""
        return self.tokens if self.packed is None else self.packed


def host_output(sample: DeviceSample, host: torch.Tensor, requests: list[Request]) -> SamplerOutput:
    """The :class:`SamplerOutput` of ``sample`` from ``host``: its :meth:`~DeviceSample.host_tensor` on the host."""
    if sample.packed is None:
        return SamplerOutput(host.tolist(), [None] * len(requests))
    packed = host.tolist()
    token_ids = [int(row[0]) for row in packed]
    entries = [None if r.params.logprobs is None else unpack(t, row[1:], r.params.logprobs, sample.k_max)
               for r, t, row in zip(requests, token_ids, packed)]
    return SamplerOutput(token_ids, entries)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, invariant: bool = False) -> None:
        self.device = device
        self.seed = seed
        self.invariant = invariant  # deterministic mode: rows grouped by their own settings (see _pick)
        self.penalty_state = DevicePenaltyState(device)   # penalties' token ids/counts, on the device per sequence
        self.grammar_masks = DeviceGrammarMasks(device)    # structured output's token masks, per sequence

    def release(self, key) -> None:
        """A sequence finished: drop its penalty counts and its grammar mask row."""
        self.penalty_state.release(key)
        self.grammar_masks.release(key)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits: ``[N, vocab]`` for ``requests`` (row i is request i's next-token distribution)."""
        sample = self.sample_on_device(logits, requests)
        return host_output(sample, sample.host_tensor(), requests)

    def sample_on_device(self, logits: torch.Tensor, requests: list[Request]) -> DeviceSample:
        """The picks of :meth:`sample`, left on the logits' device (nothing waits for them here)."""
        if logits.device.type == "cpu" and all(plain_greedy(r) for r in requests):
            tokens = native_row_argmax(logits)   # None: another dtype or layout, or no native library
            if tokens is not None:
                return DeviceSample(tokens)
        logits = logits.float()
        k_max = max((r.params.logprobs for r in requests if r.params.logprobs is not None), default=None)
        logprobs = torch.log_softmax(logits, dim=-1) if k_max is not None else None
        self._process(logits, requests)
        tokens = self._pick(logits, requests)
        if logprobs is None:
            return DeviceSample(tokens)
        packed = torch.cat([tokens[:, None].double(), gather_logprobs(logprobs, tokens, k_max)], dim=1)
        return DeviceSample(tokens, packed, k_max)

    def _process(self, logits: torch.Tensor, requests: list[Request]) -> None:
        """Logits processors and grammar masks, in place, only on the rows that use them."""
        biased = [i for i, r in enumerate(requests) if r.params.logit_bias]
        if biased:
            penalties.apply_logit_bias(logits, biased, [requests[i].params.logit_bias for i in biased])
        early = [i for i, r in enumerate(requests) if _before_min_tokens(r)]
        if early:
            penalties.apply_banned_tokens(logits, early, [_stop_ids(requests[i]) for i in early])
        penalized = [i for i, r in enumerate(requests) if r.params.has_penalties]
        if penalized:
            self._penalize(logits, penalized, requests)
        constrained = [i for i, r in enumerate(requests) if _constrained(r)]
        if constrained:
            self.grammar_masks.apply(logits, constrained, [requests[i] for i in constrained])

    def _penalize(self, logits: torch.Tensor, penalized: list[int], requests: list[Request]) -> None:
        """Penalties from the device state, one row per sequence; a key met again in the same call (a
        speculative step's draft positions: views of the request with drafts appended) is counted afresh, so
        the device state only ever holds a sequence's real tokens."""
        seen: set = set()
        tracked, afresh = [], []
        for i in penalized:
            (afresh if requests[i].key in seen else tracked).append(i)
            seen.add(requests[i].key)
        for rows, fn in ((tracked, self._penalize_tracked), (afresh, _penalize_afresh)):
            if rows:
                ps = [requests[i].params for i in rows]
                fn(logits, rows, [requests[i] for i in rows], [p.repetition_penalty for p in ps],
                   [p.presence_penalty for p in ps], [p.frequency_penalty for p in ps])

    def _penalize_tracked(self, logits, rows, reqs, repetition, presence, frequency) -> None:
        self.penalty_state.apply(logits, rows, reqs, repetition, presence, frequency)

    def _pick(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        tokens = row_argmax(logits)
        with_k = [i for i, r in enumerate(requests) if not r.params.is_greedy and r.params.top_k > 0]
        without_k = [i for i, r in enumerate(requests) if not r.params.is_greedy and r.params.top_k == 0]
        groups = ((with_k, True), (without_k, False))
        if self.invariant:
            from jobrunner.engine.invariant import sampler_groups

            groups = sampler_groups(requests, with_k, without_k)
        for rows, top_k in groups:
            if not rows:
                continue
            sub = [requests[i] for i in rows]
            dev = logits.device
            temps = to_device([r.params.temperature for r in sub], dev, torch.float32)
            top_ps = to_device([r.params.top_p for r in sub], dev, torch.float32)
            min_ps = to_device([r.params.min_p for r in sub], dev, torch.float32)
            keys = keys_tensor([row_key(r.seed, r.num_output_tokens) for r in sub], dev)
            index = to_device(rows, dev, torch.int64)
            if top_k:
                picked = filters.sample_top_k(logits[index], temps, [r.params.top_k for r in sub], top_ps,
                                              min_ps, keys)
            else:
                picked = filters.sample_full(logits[index], temps, top_ps, min_ps, keys,
                                             any(r.params.top_p < 1.0 for r in sub))
            tokens[index] = picked
        return tokens


def plain_greedy(request: Request) -> bool:
    """Whether ``request``'s next token is the argmax of its raw logits, with nothing else read from them: greedy,
    no logprobs, and none of :meth:`Sampler._process`'s steps applies (logit bias, min_tokens not yet reached,
    penalties, an active grammar). Such rows need no float32 copy of the logits."""
    p = request.params
    return (p.is_greedy and p.logprobs is None and not p.logit_bias and not p.has_penalties
            and not _before_min_tokens(request) and not _constrained(request))


def _before_min_tokens(request: Request) -> bool:
    return request.num_output_tokens < request.params.min_tokens


def _constrained(request: Request) -> bool:
    return request.grammar is not None and not request.grammar.is_terminated


def _stop_ids(request: Request) -> list[int]:
    ids = list(request.params.stop_token_ids)
    return ids if request.params.ignore_eos else ids + list(request.eos_token_ids)


def _penalize_afresh(logits, rows, reqs, repetition, presence, frequency) -> None:
    penalties.apply_penalties(logits, rows, [list(r.prompt_token_ids) for r in reqs],
                              [list(r.output_token_ids) for r in reqs], repetition, presence, frequency)
