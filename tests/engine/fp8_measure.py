"""Teacher-forced comparison of an fp8 KV cache against the model-dtype cache (shared by the fp8 engine tests).

Both engines score the same token sequences through the engine's own steps and cache: a ``loglik`` pooling
request (the first token as the prompt, the rest as the completion) returns each later token's logprob given
the tokens before it. With a large token budget a sequence is one prompt chunk (the prefill path); with
``max_num_batched_tokens=1`` every position is a one-token row (the decode kernels).
"""

from __future__ import annotations

from jobrunner.engine.pooling import PoolingParams


def teacher_forced_logprobs(engine, sequences: list[list[int]]) -> list[list[float]]:
    """Per sequence, the logprob of each token after the first, as ``engine`` computes it through its cache."""
    params = [PoolingParams(task="loglik", completion=seq[1:]) for seq in sequences]
    outs = engine.generate([seq[:1] for seq in sequences], params)
    return [out.pooled.completion_logprobs for out in outs]


def max_abs_difference(a: list[list[float]], b: list[list[float]]) -> float:
    """The largest |a - b| over every position of every sequence."""
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b, strict=True))


def mean_abs_difference(a: list[list[float]], b: list[list[float]]) -> float:
    """The mean |a - b| over every position of every sequence."""
    diffs = [abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b, strict=True)]
    return sum(diffs) / len(diffs)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
