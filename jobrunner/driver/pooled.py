"""Embed and score jobs: the spec's task as the engine's prefill-only requests, and their results as columns.

A job's *output task* is ``generate``, ``embed``, ``classify`` (task score with a sequence-classification
head) or ``loglik`` (task score with ``input.completion_column``). Rows of the last three go through the same
row pipeline as generation (reading, sharding, admission, isolation, parts, resume); only the request's
parameters (:class:`~jobrunner.engine.PoolingParams` instead of sampling) and the result columns differ.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jobrunner.engine import PoolingParams
from jobrunner.spec import JobSpec

# The result columns of each output task (their Arrow types: jobrunner.io.parts.TASK_FIELDS).
TASK_COLUMNS = {"embed": ("embedding",), "classify": ("scores",),
                "loglik": ("completion_logprob", "completion_logprobs", "num_completion_tokens")}


def output_task(spec: JobSpec) -> str:
    """``generate`` | ``embed`` | ``classify`` | ``loglik``."""
    if spec.task == "score":
        return "loglik" if spec.input.completion_column else "classify"
    return spec.task


def job_pooling(spec: JobSpec, model_info: dict[str, Any] | None) -> PoolingParams | None:
    """The job's prefill-only request parameters (None for generation), resolved once per worker against what
    the loaded model says (``model_info``: head, pooling, normalize); ValueError when an ``auto`` pooling is
    one the engine cannot compute."""
    task = output_task(spec)
    if task == "generate":
        return None
    if task != "embed":
        return PoolingParams(task=task)
    info = model_info or {}
    pooling = spec.embed.pooling
    if pooling == "auto":
        if info.get("pooling_error"):
            raise ValueError(f"embed.pooling auto: {info['pooling_error']}; set embed.pooling to last, mean or cls")
        pooling = info.get("pooling") or "last"
    normalize = spec.embed.normalize
    normalize = bool(info.get("normalize", False)) if normalize == "auto" else bool(normalize)
    return PoolingParams(task="embed", pooling=pooling, normalize=normalize)


def row_pooling(spec: JobSpec, template: PoolingParams, row: dict[str, Any]) -> PoolingParams:
    """A row's parameters: the job's, with the row's completion for log-likelihood scoring; ValueError names
    the column when it is null or empty."""
    if template.task != "loglik":
        return template
    column = spec.input.completion_column
    value = row.get(column)
    if not isinstance(value, str) or not value:
        raise ValueError(f"completion column {column!r} is null, empty or not a string")
    return dataclasses.replace(template, completion=value)


def result_columns(task: str, out: Any) -> dict[str, Any]:
    """A finished prefill-only request's result columns (None where it failed)."""
    pooled = getattr(out, "pooled", None)
    if task == "embed":
        return {"embedding": None if pooled is None else pooled.embedding}
    if task == "classify":
        return {"scores": None if pooled is None else pooled.scores}
    values = None if pooled is None else pooled.completion_logprobs
    return {"completion_logprob": None if values is None else float(sum(values)), "completion_logprobs": values,
            "num_completion_tokens": None if values is None else len(values)}


def task_facts(spec: JobSpec, model_info: dict[str, Any] | None, pooling: PoolingParams | None) -> dict[str, Any]:
    """What the manifest's ``model`` section records of an embed / score job: the task, the pooling, the
    embedding dimension, the label names of a classifier."""
    task = output_task(spec)
    if task == "generate":
        return {}
    info = model_info or {}
    facts: dict[str, Any] = {"task": task}
    if task == "embed" and pooling is not None:
        facts.update(pooling=pooling.pooling, normalize=pooling.normalize, embedding_dim=info.get("hidden_size"),
                     pooling_source="spec" if spec.embed.pooling != "auto" else info.get("pooling_source"))
    if task == "classify":
        facts.update(labels=list(info.get("labels") or []), num_labels=len(info.get("labels") or []))
    return facts
