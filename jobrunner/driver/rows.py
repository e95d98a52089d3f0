"""Rows to requests and finished requests to output rows.

A row that cannot become a request (null or empty prompt, bad messages, bad per-row sampling override,
null id) becomes an output row with `error` set right away; it never reaches the engine and never fails
its shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobrunner.engine import SamplingParams
from jobrunner.io.reader import ROW_INDEX, parse_messages, parse_overrides
from jobrunner.spec import JobSpec


@dataclass
class RowRequest:
    """A row ready for the engine (prompt set) or already failed (error set)."""

    row_id: str
    row_index: int
    prompt: str | list[dict[str, Any]] | None = None
    params: SamplingParams | None = None
    error: str | None = None


def row_id(spec: JobSpec, file_stem: str, row: dict[str, Any]) -> tuple[str, str | None]:
    """The row's id and an error when the id column is null (the derived id is used then)."""
    derived = f"{file_stem}:{row[ROW_INDEX]}"
    column = spec.input.id_column
    if column is None:
        return derived, None
    value = row.get(column)
    if value is None:
        return derived, f"id column {column!r} is null (row {derived})"
    return str(value), None


def to_request(spec: JobSpec, file_stem: str, row: dict[str, Any]) -> RowRequest:
    """Build the request of one input row, or an error row."""
    rid, id_error = row_id(spec, file_stem, row)
    req = RowRequest(row_id=rid, row_index=row[ROW_INDEX], error=id_error)
    if req.error:
        return req
    try:
        req.prompt = _prompt(spec, row)
        req.params = _params(spec, row)
    except ValueError as exc:
        req.prompt, req.params, req.error = None, None, str(exc)
    return req


def _prompt(spec: JobSpec, row: dict[str, Any]) -> str | list[dict[str, Any]]:
    if spec.input.prompt_column is not None:
        value = row.get(spec.input.prompt_column)
        if value is None or not str(value).strip():
            raise ValueError(f"prompt column {spec.input.prompt_column!r} is null or empty")
        return str(value)
    column = spec.input.messages_column
    try:
        return parse_messages(row.get(column))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"messages column {column!r}: {exc}") from None


def _params(spec: JobSpec, row: dict[str, Any]) -> SamplingParams:
    values = spec.sampling.model_dump()
    column = spec.input.sampling_column
    if column is not None:
        try:
            values.update(parse_overrides(row.get(column)))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"sampling column {column!r}: {exc}") from None
    try:
        return SamplingParams.from_dict(values)
    except (ValueError, TypeError) as exc:
        where = f"bad sampling override in column {column!r}" if column else "bad sampling settings"
        raise ValueError(f"{where}: {exc}") from None


def error_row(req: RowRequest) -> dict[str, Any]:
    """The output row of a row that never reached the engine."""
    return {"id": req.row_id, ROW_INDEX: req.row_index, "generated_text": None, "finish_reason": "error",
            "error": req.error, "num_prompt_tokens": 0, "num_cached_tokens": 0, "num_output_tokens": 0}


def output_row(req: RowRequest, out: Any) -> dict[str, Any]:
    """The output row of a finished engine request (a RequestOutput)."""
    metrics = out.metrics.to_dict()
    failed = out.finish_reason == "error"
    row = {"id": req.row_id, ROW_INDEX: req.row_index, "generated_text": None if failed else out.text,
           "finish_reason": out.finish_reason, "error": out.error or ("engine error" if failed else None)}
    for key in ("num_prompt_tokens", "num_cached_tokens", "num_output_tokens"):
        row[key] = int(metrics.get(key) or 0)
    for key in ("ttft_s", "itl_mean_s", "e2e_s", "queue_s"):
        row[key] = metrics.get(key)
    return row
