"""Turn the last-position logits of each sampling request into its next token.

Greedy rows take the argmax. Other rows are scaled by temperature, filtered by top-k and top-p, then sampled
with the exponential-race trick (argmax of probs / Exp(1) noise), which draws exactly from the distribution.
A row with a seed draws its noise from a generator seeded by (seed, output position), so its text depends only
on its own seed — not on what it is batched with, nor on preemption and recompute.
"""

from __future__ import annotations

import torch

from jobrunner.engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
               want_logprobs: bool) -> tuple[list[int], list[float] | None]:
        """logits: [N, vocab]; positions: each row's output index (seeds the per-request stream)."""
        logits = logits.float()
        if all(p.is_greedy for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample_mixed(logits, params, positions)
        logprobs = None
        if want_logprobs:
            logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1).tolist()
        return tokens.tolist(), logprobs

    def _sample_mixed(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]
                      ) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.is_greedy]
        sub = logits[rows]
        temps = torch.tensor([params[i].temperature for i in rows], device=logits.device)
        probs = torch.softmax(_top_k_top_p(sub / temps[:, None], [params[i] for i in rows]), dim=-1)
        noise = torch.stack([self._noise(params[i], positions[i], sub.shape[1]) for i in rows])
        sampled = (probs / noise).argmax(dim=-1)
        greedy[rows] = sampled
        return greedy

    def _noise(self, params: SamplingParams, position: int, vocab: int) -> torch.Tensor:
        generator = self.generator
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(hash((params.seed, position)) & 0x7FFF_FFFF_FFFF_FFFF)
        return torch.empty(vocab, device=self.device).exponential_(generator=generator)


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    top_ks = [p.top_k for p in params]
    top_ps = [p.top_p for p in params]
    if not any(top_ks) and all(p >= 1.0 for p in top_ps):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    remove = ranks >= ks[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    # drop tokens once the mass *before* them already reaches top_p (the top token always stays)
    mass_before = probs.cumsum(dim=-1) - probs
    ps = torch.tensor(top_ps, device=logits.device)
    remove |= mass_before >= ps[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
