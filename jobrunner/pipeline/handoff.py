"""How one stage's output rows become the next stage's input rows (or the pipeline's final rows).

For each output row of stage k, in this order: an error row stops here (counted `error`); the stage's
`output_columns` are computed (`json.<key>...` from the first JSON object in `generated_text`, plus
`json_valid`); the stage's filter decides (`dropped`, or `filter_error` when it cannot decide the row); a kept
row carries every column but the per-request metrics, a column named like one of the next stage's own
output columns renamed `<stage k>.<column>`, and gets the next stage's request built from it: the prompt
template, or the conversation so far (`conversation`, JSON text) with the appended message templates. A
template that meets a null or absent column makes the row the next stage's error row (`error` set), so the
next stage writes it as an error row with that text.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from jobrunner.pipeline.expr import Filter, FilterError
from jobrunner.pipeline.template import Template, TemplateError

# Columns of an output row that describe how it ran, not what it is: never carried to the next stage.
METRIC_COLUMNS = frozenset({
    "error", "num_prompt_tokens", "num_cached_tokens", "num_output_tokens", "ttft_s", "itl_mean_s", "e2e_s",
    "queue_s", "shard_id", "worker_id", "finish_time_s", "sample_index", "prompt_shared", "logprobs",
    "prompt_logprobs", "request_fingerprint", "output_fingerprint", "dedupe_of", "num_reasoning_tokens",
    "completion_logprobs", "num_completion_tokens", "tool_call_warning", "num_images", "num_image_tokens"})
# A stage's result columns, whichever settings made them: carried to the next stage under `<stage>.<name>`, so that
# no later stage's output holds a column its reports would read as its own (a judge's json_valid, an embedding).
RESULT_COLUMNS = frozenset({
    "generated_text", "finish_reason", "json_valid", "reasoning", "tool_calls", "embedding", "scores",
    "completion_logprob", "adapter", "messages"})
PROMPT_COLUMN = "_stage_prompt"  # the next stage's input: its built prompt ...
MESSAGES_COLUMN = "_stage_messages"  # ... or chat (JSON text)
COMPLETION_COLUMN = "_stage_completion"  # a score stage's completion
CONVERSATION = "conversation"  # carried: the messages a stage was sent (JSON text), for the next to append to
JSON_VALID = "json_valid"
OUTCOMES = ("kept", "dropped", "filter_error", "error")


@dataclass(frozen=True)
class NextRequest:
    """How the next stage's request is built (one of prompt / messages), and its output column names."""

    prompt: Template | None = None
    messages: tuple[tuple[str, Template], ...] = ()
    completion: Template | None = None
    output_names: frozenset[str] = frozenset()  # the next stage's own output columns (carried ones are renamed)
    stage: str = "next"  # the next stage's name (named in a row's template error)


@dataclass(frozen=True)
class Handoff:
    """Stage `stage`'s rows handed on: to the next stage (`next` set) or to the final output (`next` None)."""

    stage: str
    output_columns: dict[str, tuple[str, ...]] = field(default_factory=dict)  # name -> JSON key path
    filter: Filter | None = None
    next: NextRequest | None = None
    base_prompt_column: str | None = None  # the conversation's start when no `conversation` is carried
    base_messages_column: str | None = None

    def enrich(self, row: dict[str, Any]) -> dict[str, Any]:
        """The row with the stage's output_columns (and json_valid) added."""
        if not self.output_columns:
            return row
        parsed = first_json_object(row.get("generated_text"))
        out = dict(row)
        for name, path in self.output_columns.items():
            out[name] = _dig(parsed, path)
        if JSON_VALID not in row or row.get(JSON_VALID) is None:
            out[JSON_VALID] = parsed is not None
        return out

    def decide(self, row: dict[str, Any]) -> tuple[str, str | None]:
        """(outcome, message): 'error' (an error row), 'dropped', 'filter_error' (message names the stage,
        columns and row id) or 'kept'; `row` is already enriched."""
        if row.get("error") is not None:
            return "error", None
        if self.filter is None:
            return "kept", None
        try:
            return ("kept", None) if self.filter.keeps(row, str(row.get("id"))) else ("dropped", None)
        except FilterError as exc:
            return "filter_error", f"stage {self.stage}: {exc}"

    def next_row(self, row: dict[str, Any]) -> dict[str, Any]:
        """The next stage's input row: carried columns, the built request columns, and `error` (a template
        that could not be filled, naming the stage, the column and the row id) or None."""
        assert self.next is not None, "the last stage's rows go to the final output"
        out = {self.carried_name(k): v for k, v in row.items() if k not in METRIC_COLUMNS and k != "id"}
        out["id"] = row.get("id")
        out.update({PROMPT_COLUMN: None, MESSAGES_COLUMN: None, COMPLETION_COLUMN: None, "error": None})
        try:
            self._fill_request(row, out)
        except TemplateError as exc:
            out[PROMPT_COLUMN] = out[MESSAGES_COLUMN] = out[COMPLETION_COLUMN] = None
            out["error"] = f"stage {self.next.stage}: {exc} in row {row.get('id')}"
        return out

    def carried_name(self, column: str) -> str:
        """`<stage>.<column>` for a result column or one named like a next stage's output column."""
        clashes = column in self.next.output_names or column in RESULT_COLUMNS
        return f"{self.stage}.{column}" if clashes else column

    def _fill_request(self, row: dict[str, Any], out: dict[str, Any]) -> None:
        nxt = self.next
        if nxt.prompt is not None:
            out[PROMPT_COLUMN] = nxt.prompt.render(row)
            out[CONVERSATION] = json.dumps([{"role": "user", "content": out[PROMPT_COLUMN]}], ensure_ascii=False)
        else:
            chat = self.conversation(row) + [{"role": role, "content": t.render(row)} for role, t in nxt.messages]
            out[MESSAGES_COLUMN] = out[CONVERSATION] = json.dumps(chat, ensure_ascii=False)
        if nxt.completion is not None:
            out[COMPLETION_COLUMN] = nxt.completion.render(row)

    def conversation(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """The messages this stage was sent, then its reply (for a next stage that appends messages)."""
        carried = row.get(CONVERSATION)
        if carried:
            chat = json.loads(carried)
        elif self.base_messages_column is not None:
            value = row.get(self.base_messages_column)
            chat = json.loads(value) if isinstance(value, str) else [dict(m) for m in value or []]
        else:
            column = self.base_prompt_column or "prompt"
            if row.get(column) is None:
                raise TemplateError(f"conversation column {column!r} is null")
            chat = [{"role": "user", "content": str(row[column])}]
        if row.get("generated_text") is None:
            raise TemplateError("template column 'generated_text' is null")
        return [*chat, {"role": "assistant", "content": row["generated_text"]}]


@dataclass
class Funnel:
    """Rows of one stage by outcome (rows in = their sum), and the first filter errors."""

    counts: Counter = field(default_factory=Counter)
    filter_errors: list[str] = field(default_factory=list)

    def add(self, outcome: str, message: str | None = None, keep_messages: int = 5) -> None:
        self.counts[outcome] += 1
        if message and len(self.filter_errors) < keep_messages:
            self.filter_errors.append(message)

    def merge(self, other: Funnel) -> None:
        self.counts.update(other.counts)
        self.filter_errors.extend(other.filter_errors[:max(0, 5 - len(self.filter_errors))])

    def to_dict(self) -> dict[str, Any]:
        rows_in = sum(self.counts.values())
        return {"rows_in": rows_in, **{k: int(self.counts.get(k, 0)) for k in OUTCOMES},
                "filter_error_examples": list(self.filter_errors)}


def first_json_object(text: Any) -> dict[str, Any] | None:
    """The first JSON object in a text (a model often wraps it in prose or a code fence), else None."""
    if not isinstance(text, str):
        return None
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            start = text.find("{", start + 1)
            continue
        if isinstance(value, dict):
            return value
        start = text.find("{", start + 1)
    return None


def parse_output_column(name: str, source: str) -> tuple[str, ...]:
    """`json.score` -> ('score',); ValueError naming the column for any other form."""
    head, _, rest = source.partition(".")
    if head != "json" or not rest or any(not part for part in rest.split(".")):
        raise ValueError(f"output_columns.{name}: {source!r} is not 'json.<key>[.<key>...]' (a key of the JSON "
                         "object in generated_text)")
    return tuple(rest.split("."))


def _dig(value: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if isinstance(value, dict):
            value = value.get(key)
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            return None
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return value
