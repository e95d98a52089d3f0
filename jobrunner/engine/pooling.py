"""Prefill-only requests: embeddings, classification / reward scores and log-likelihoods of given completions.

A pooling request is prefilled through the scheduler like any prompt (chunked prefill, prefix-cache hits,
preemption) and finishes as soon as its last token is computed, with no sampled token. Each step the model
runner hands the hidden states of the request's scheduled tokens to :func:`collect`, which keeps only what the
task needs on the request's :class:`PoolingState`:

* ``embed``: the last token's hidden state (``last``), the first token's (``cls``), or the running sum of every
  token's (``mean``), L2-normalised at the end when asked;
* ``classify``: the model's ``score`` head on the last token's hidden state (``*ForSequenceClassification``);
* ``loglik``: the log-probability of every completion token given the tokens before it (teacher forcing).

Which positions must be computed is :func:`first_needed`: a prefix-cache hit never covers
them (KVCacheManager.find_cached_prefix caps the hit there), so mean / cls pooling take no hit and a
log-likelihood request may reuse its shared prompt but not the token before its completion. The state is
reset whenever the scheduler (re)admits the request, so a preempted request recomputes into a clean state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where the hidden states are read: the params import nothing heavy
    import torch

POOLING_MODES = ("last", "mean", "cls")
TASKS = ("embed", "classify", "loglik")


@dataclass(frozen=True)
class PoolingParams:
    """What a prefill-only request returns instead of generated text.

    ``task``: ``embed`` | ``classify`` | ``loglik``. ``pooling`` (embed): ``last`` | ``mean`` | ``cls``;
    ``normalize`` (embed): L2-normalise the vector. ``completion`` (loglik): the text (or token ids) whose
    log-likelihood is scored after the prompt; it is tokenized without special tokens and appended to the
    prompt's tokens.
    """

    task: str = "embed"
    pooling: str = "last"
    normalize: bool = False
    completion: str | list[int] | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"pooling task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.pooling not in POOLING_MODES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_MODES)}, got {self.pooling!r}")

    @property
    def n(self) -> int:
        """One output per request (callers count samples the same way for every request)."""
        return 1


@dataclass
class PooledOutput:
    """The result of a prefill-only request (one field set, by task)."""

    embedding: list[float] | None = None
    scores: list[float] | None = None
    completion_logprobs: list[float] | None = None  # one per completion token

    @property
    def completion_logprob(self) -> float | None:
        """The completion's log-likelihood (the sum of its tokens' log-probabilities)."""
        return None if self.completion_logprobs is None else float(sum(self.completion_logprobs))


@dataclass
class PoolingState:
    """What a running pooling request has kept of the hidden states computed so far."""

    vector: torch.Tensor | None = None          # last / cls: that token's hidden state; mean: the running sum
    num_pooled: int = 0                         # mean: tokens summed so far
    logprobs: list[float] = field(default_factory=list)  # loglik: completion tokens scored so far


def first_needed(params: PoolingParams, num_prompt_tokens: int, num_tokens: int) -> int:
    """The first position whose hidden state the task reads (a prefix-cache hit must stop before it).

    ``num_prompt_tokens``: tokens before the completion (loglik); ``num_tokens``: the whole sequence.
    """
    if params.task == "loglik":
        return num_prompt_tokens - 1   # its hidden state predicts the first completion token
    if params.task == "embed" and params.pooling in ("mean", "cls"):
        return 0
    return num_tokens - 1


def collect(model: torch.nn.Module, request, hidden: torch.Tensor, start: int) -> None:
    """Keep what ``request``'s task needs from ``hidden`` ``[n, hidden_size]``: the hidden states of its
    positions ``start .. start + n - 1`` computed this step."""
    params, state = request.pooling, request.pool_state
    end = start + hidden.shape[0]
    last = request.num_tokens - 1
    if params.task == "loglik":
        _collect_logprobs(model, request, hidden, start)
    elif params.task == "embed" and params.pooling == "mean":
        total = hidden.float().sum(0)
        state.vector = total if state.vector is None else state.vector + total
        state.num_pooled += hidden.shape[0]
    elif params.task == "embed" and params.pooling == "cls":
        if start == 0:
            state.vector = hidden[0].float()
    elif start <= last < end:  # last-token embedding, classification head
        state.vector = hidden[last - start].float()


def _collect_logprobs(model: torch.nn.Module, request, hidden: torch.Tensor, start: int) -> None:
    """Log-probabilities of the completion tokens this chunk predicts (row i predicts position i + 1)."""
    import torch

    first = request.pool_prompt_len - 1             # predicts the first completion token
    lo, hi = max(start, first), min(start + hidden.shape[0], request.num_tokens - 1)
    if lo >= hi:
        return
    logits = model.compute_logits(hidden[lo - start:hi - start]).float()
    targets = torch.tensor(request.all_token_ids[lo + 1:hi + 1], device=logits.device)
    values = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)
    request.pool_state.logprobs.extend(values.tolist())


def finish(model: torch.nn.Module, request) -> PooledOutput:
    """The request's result once its last token is computed."""
    import torch

    params, state = request.pooling, request.pool_state
    if params.task == "loglik":
        return PooledOutput(completion_logprobs=list(state.logprobs))
    vector = state.vector
    if params.task == "classify":
        return PooledOutput(scores=model.compute_scores(vector.to(model.dtype)[None]).float()[0].tolist())
    if params.pooling == "mean":
        vector = vector / max(state.num_pooled, 1)
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return PooledOutput(embedding=vector.tolist())
