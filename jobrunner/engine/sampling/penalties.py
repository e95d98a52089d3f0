"""Logits processors applied before sampling: logit bias, min_tokens, repetition / presence / frequency penalties.

Each works on a batch of rows at once, so a step costs a few vectorised ops however many rows ask for it. The
engine's sampler keeps the penalties' token ids and counts on the device, adds each step's new tokens and
penalizes only the ids a row holds (:mod:`jobrunner.engine.sampling.token_counts`); :func:`apply_penalties`
rebuilds ``[rows, vocab]`` counts from whole token lists (padded into one ``[rows, L]`` tensor, pad index
``vocab``): the reference the device state is tested against, with the same float32 formulas.
Semantics follow transformers / vLLM / OpenAI:
- repetition_penalty (CTRL, transformers' RepetitionPenaltyLogitsProcessor): over prompt + output tokens, a
  seen token's logit is divided by the penalty when positive and multiplied by it when negative;
- presence / frequency penalty (OpenAI): over output tokens, ``logit -= frequency * count + presence * (count > 0)``;
- logit_bias: added to the logits (token id -> bias);
- min_tokens: EOS and stop token ids are masked until that many tokens were generated.
"""

from __future__ import annotations

import torch

from jobrunner.engine.sampling import to_device


def token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[rows, vocab]`` float counts of each token id in each row's list."""
    width = max(max((len(t) for t in token_lists), default=0), 1)
    padded = torch.tensor([list(t) + [vocab] * (width - len(t)) for t in token_lists], dtype=torch.int64)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded if device.type == "cpu" else padded.to(device, non_blocking=True),
                        torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def apply_repetition_penalty(logits: torch.Tensor, seen_counts: torch.Tensor, penalties: torch.Tensor) -> None:
    """In place on ``logits`` ``[R, V]``; ``seen_counts`` ``[R, V]`` (prompt + output); ``penalties`` ``[R]``."""
    p = penalties[:, None]
    penalized = torch.where(logits < 0, logits * p, logits / p)
    logits.copy_(torch.where(seen_counts > 0, penalized, logits))


def apply_presence_frequency(logits: torch.Tensor, output_counts: torch.Tensor, presence: torch.Tensor,
                             frequency: torch.Tensor) -> None:
    """In place: ``logits -= frequency * count + presence * (count > 0)`` over output tokens, per row."""
    logits -= frequency[:, None] * output_counts + presence[:, None] * (output_counts > 0).float()


def apply_logit_bias(logits: torch.Tensor, rows: list[int], biases: list[dict[int, float]]) -> None:
    """In place: add each row's ``{token_id: bias}`` (ids outside the vocabulary are ignored)."""
    vocab = logits.shape[-1]
    index = [(r, t, b) for r, bias in zip(rows, biases) for t, b in bias.items() if t < vocab]
    if not index:
        return
    r, t, b = zip(*index)
    dev = logits.device
    logits.index_put_((to_device(r, dev, torch.int64), to_device(t, dev, torch.int64)),
                      to_device(b, dev, logits.dtype), accumulate=True)


def apply_banned_tokens(logits: torch.Tensor, rows: list[int], banned: list[list[int]]) -> None:
    """In place: ``-inf`` for each row's banned token ids (min_tokens: EOS and stop tokens)."""
    vocab = logits.shape[-1]
    index = [(r, t) for r, tokens in zip(rows, banned) for t in tokens if 0 <= t < vocab]
    if index:
        r, t = zip(*index)
        dev = logits.device
        logits[to_device(r, dev, torch.int64), to_device(t, dev, torch.int64)] = float("-inf")


def apply_penalties(logits: torch.Tensor, rows: list[int], prompts: list[list[int]], outputs: list[list[int]],
                    repetition: list[float], presence: list[float], frequency: list[float]) -> None:
    """All three penalties for the given rows of ``logits`` (in place), counting the token lists afresh."""
    dev, vocab = logits.device, logits.shape[-1]
    out_counts = token_counts(outputs, vocab, dev)
    seen = out_counts + token_counts(prompts, vocab, dev) if any(p != 1.0 for p in repetition) else None
    apply_counted_penalties(logits, rows, out_counts, seen, repetition, presence, frequency)


def apply_counted_penalties(logits: torch.Tensor, rows: list[int], out_counts: torch.Tensor,
                            seen: torch.Tensor | None, repetition: list[float], presence: list[float],
                            frequency: list[float]) -> None:
    """All three penalties for the given rows of ``logits`` (in place), from counts ``[len(rows), vocab]``.

    ``out_counts``: output tokens; ``seen``: prompt + output tokens (needed when a repetition penalty is not 1).
    """
    dev = logits.device
    index = to_device(rows, dev, torch.int64)
    sub = logits.index_select(0, index)
    if any(p != 1.0 for p in repetition):
        apply_repetition_penalty(sub, seen, to_device(repetition, dev, torch.float32))
    if any(presence) or any(frequency):
        apply_presence_frequency(sub, out_counts, to_device(presence, dev, torch.float32),
                                 to_device(frequency, dev, torch.float32))
    logits.index_copy_(0, index, sub)
