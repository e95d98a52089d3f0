"""`jobrunner validate`'s row check: the rows a worker would write as error rows, found before any worker starts.

Each row read becomes its request through the worker's own code (driver/rows.py: ``to_request``: per-row
sampling overrides against the engine's bounds, OpenAI request bodies and their ``model``, messages, tools),
and each constrained request's grammar is built by the engine's own function
(engine/sampling/structured.py: ``structured_grammar``, what the worker compiles). So validate refuses a
``temperature: -1`` in a sampling column, a schema that is not JSON or has ``"type": "objekt"``, or a
/v1/chat/completions line for a base model, naming the row, instead of the worker writing an error row after
loading the model. At most ``MAX_ROWS`` rows are read (the first rows of each file in turn). Lines that could
not be read at all and null ids are not counted here: validate lists the bad lines on their own, and an id is
the id check's business; a row whose data has no usable prompt (null, messages that do not parse) is warned
about, as a bad line is, not refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from jobrunner.driver.chat_check import is_chat_prompt, lacks_chat_template, no_template
from jobrunner.driver.openai_batch import model_mismatch
from jobrunner.driver.plan import JobPlan
from jobrunner.driver.rows import (
    RowRequest,
    is_generating,
    is_openai_batch,
    job_sampling,
    read_shard_input,
    row_id,
    to_request,
)
from jobrunner.io.reader import ROW_ERROR
from jobrunner.spec import JobSpec

MAX_ROWS = 5_000
SHOWN_ROWS = 10
# A row's own data that is not a prompt (a null prompt, messages that do not parse): an error row like a bad
# line, warned about, not refused; every other reason is a setting (per-row or the job's) a worker refuses.
DATA_ERRORS = ("prompt column ", "messages column ")


@dataclass
class RowsRead:
    """The requests of the rows read (error rows included), and the ids whose error is not the request's own
    (an unreadable line or a null id: reported elsewhere)."""

    requests: list[RowRequest] = field(default_factory=list)
    not_request_errors: set[str] = field(default_factory=set)
    other_model: list[str] = field(default_factory=list)  # OpenAI lines naming another model (warn mode)


@dataclass
class RowCheck:
    """What the row check found: (row id, why) for each row a worker would refuse, and notes for validate."""

    rows_read: int = 0
    refused: list[tuple[str, str]] = field(default_factory=list)
    no_prompt: list[tuple[str, str]] = field(default_factory=list)  # (row id, why): error rows, not refused
    notes: list[str] = field(default_factory=list)


def read_requests(spec: JobSpec, plan: JobPlan, max_rows: int = MAX_ROWS) -> RowsRead:
    """Up to ``max_rows`` rows of ``plan``'s files, each made into its request as a worker makes it."""
    sampling = job_sampling(spec) if is_generating(spec) else _pooling(spec)
    out = RowsRead()
    for file in plan.files:
        take = min(file.num_rows, max_rows - len(out.requests))
        if take <= 0:
            break
        table, _ = read_shard_input(spec, file.url, 0, take)
        for row in table.to_pylist():
            req = to_request(spec, file.stem, row, sampling)
            out.requests.append(req)
            if req.error and req.error in (row.get(ROW_ERROR), row_id(spec, file.stem, row)[1]):
                out.not_request_errors.add(req.row_id)
            elif not req.error and is_openai_batch(spec) and _names_other_model(spec, row):
                out.other_model.append(req.row_id)
    return out


def check_rows(spec: JobSpec, rows: RowsRead) -> RowCheck:
    """The rows of ``rows`` a worker would refuse, with the worker's reason (the first reason per row)."""
    out = RowCheck(rows_read=len(rows.requests))
    grammars = _GrammarCheck(spec)
    chat_refused = is_generating(spec) and lacks_chat_template(spec)
    for req in rows.requests:
        if req.row_id in rows.not_request_errors:
            continue
        why = req.error or grammars.problem(req.params)
        if why is None and chat_refused and is_chat_prompt(req.prompt):
            why = f"a chat ({req.endpoint or 'messages'}) row, but {no_template(spec)}"
        if why:
            (out.no_prompt if why.startswith(DATA_ERRORS) else out.refused).append((req.row_id, why))
    out.notes.extend(grammars.notes)
    if out.no_prompt:
        rid, why = out.no_prompt[0]
        out.notes.append(f"WARNING: {len(out.no_prompt)} row(s) have no usable prompt and will be error rows "
                         f"({_ids([i for i, _ in out.no_prompt])}); row {rid!r}: {why}")
    if rows.other_model:
        out.notes.append(f"WARNING: {len(rows.other_model)} line(s) name another model than {spec.model.source!r} "
                         f"in body.model ({_ids(rows.other_model)}); they are served by the job's model "
                         "(input.openai_model_mismatch: warn)")
    return out


def job_constraint_problem(spec: JobSpec) -> str | None:
    """The job's own constraint (sampling.json_schema / regex / choice) built as the worker builds it: one line
    when it is bad (every row would be an error row), None when it is fine or there is none."""
    if not is_generating(spec) or all(getattr(spec.sampling, k) is None for k in ("json_schema", "regex", "choice")):
        return None
    check = _GrammarCheck(spec)
    why = check.problem(job_sampling(spec))
    return f"sampling: {why.removeprefix('bad sampling settings: ')}" if why else None


def describe_refused(check: RowCheck, total_rows: int) -> str:
    """validate's error: how many rows read a worker would refuse, then one line per row (row id: why)."""
    read = f"{check.rows_read} of {total_rows} rows read" if check.rows_read < total_rows else \
        f"all {total_rows} rows read"
    lines = [f"{len(check.refused)} row(s) would be error rows ({read}); fix them or the settings named:"]
    lines += [f"  row {rid!r}: {why}" for rid, why in check.refused[:SHOWN_ROWS]]
    if len(check.refused) > SHOWN_ROWS:
        lines.append(f"  ... and {len(check.refused) - SHOWN_ROWS} more")
    return "\n".join(lines)


class _GrammarCheck:
    """Each distinct constraint built once by the engine's ``structured_grammar`` (our engine only: vLLM and a
    custom factory check their own)."""

    def __init__(self, spec: JobSpec) -> None:
        self.enabled = spec.engine.backend == "jobrunner" and not spec.engine.factory
        self.seen: dict[str, str | None] = {}
        self.notes: list[str] = []

    def problem(self, params: Any) -> str | None:
        if not self.enabled or not getattr(params, "is_structured", False):
            return None
        key = json.dumps([params.json_schema, params.regex, params.choice], sort_keys=True)
        if key not in self.seen:
            self.seen[key] = self._build(params)
        return self.seen[key]

    def _build(self, params: Any) -> str | None:
        from jobrunner.engine.sampling.structured import GrammarUnavailable, structured_grammar

        try:
            structured_grammar(params)
        except GrammarUnavailable as exc:
            self.enabled = False
            self.notes.append(f"structured-output constraints not checked: {exc}")
        except ValueError as exc:
            return f"bad sampling settings: {exc}"
        return None


def _names_other_model(spec: JobSpec, row: dict[str, Any]) -> bool:
    body = row.get("body")
    try:
        body = json.loads(body) if isinstance(body, str) else body
    except ValueError:
        return False
    model = body.get("model") if isinstance(body, dict) else None
    return model_mismatch(None if model in (None, "") else str(model), spec.model.source) is not None


def _pooling(spec: JobSpec) -> Any:
    from jobrunner.driver.pooled import job_pooling

    return job_pooling(spec)


def _ids(ids: list[str]) -> str:
    shown = ", ".join(repr(i) for i in ids[:3])
    return f"ids {shown}" + (f" and {len(ids) - 3} more" if len(ids) > 3 else "")
