"""Rows to requests and finished requests to output rows.

A row that cannot become a request (null or empty prompt, bad messages, bad per-row sampling override or
OpenAI request body, null id) becomes an output row with `error` set right away; it never reaches the engine
and never fails its shard. A row sampled n times comes back as n output rows with the same id and
`sample_index` 0..n-1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from jobrunner.driver.json_check import json_valid
from jobrunner.driver.openai_batch import model_mismatch, parse_request
from jobrunner.driver.pooled import output_task, result_columns, row_pooling
from jobrunner.driver.row_images import has_images, image_tokens
from jobrunner.driver.row_seeds import seeded
from jobrunner.driver.tool_calls import (
    check_tools,
    endpoint_tool_calls,
    forced_call_schema,
    given_tool_calls,
    openai_tool_calls,
    parse_forced_call,
    parse_tool_calls,
)
from jobrunner.engine import PoolingParams, SamplingParams
from jobrunner.io.fingerprints import request_fingerprints, text_salt
from jobrunner.io.image_parts import check_count, column_refs, parts_text, with_images
from jobrunner.io.image_prints import ImagePrints
from jobrunner.io.parts import output_schema
from jobrunner.io.reader import ROW_ERROR, ROW_INDEX, parse_messages, parse_overrides
from jobrunner.io.text_input import read_input_rows
from jobrunner.io.text_lines import OPENAI_COLUMNS
from jobrunner.redaction import redact_text
from jobrunner.spec import JobSpec

OPENAI_ID_COLUMN = "custom_id"


@dataclass
class RowRequest:
    """A row ready for the engine (prompt set) or already failed (error set)."""

    row_id: str
    row_index: int
    prompt: str | list[int] | list[dict[str, Any]] | None = None
    params: SamplingParams | PoolingParams | None = None  # PoolingParams: an embed / score job's row
    error: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    endpoint: str | None = None  # OpenAI batch rows: "chat", "completions" or "embeddings"
    tools: list[dict[str, Any]] | None = None  # the row's tools (they reach the template as `tools`)
    forced_tool: bool = False  # tool_choice required / named: the reply is one call's JSON
    adapter: str | None = None  # the LoRA adapter it runs with (input.adapter_column; None: the base model)
    num_finished: int = 0  # samples the engine has finished (the request is done at params.n)
    dedupe_of: str | None = None  # output.dedupe prompts: the earlier row it repeats (error says so; not generated)
    num_images: int = 0  # image parts in the prompt (fetched by the worker just before the engine: io/images.py)


def is_openai_batch(spec: JobSpec) -> bool:
    """Whether the job reads OpenAI batch request lines (and writes OpenAI-style result files)."""
    return spec.input.format == "openai_batch"


def id_column(spec: JobSpec) -> str | None:
    """The input column holding row ids (custom_id for OpenAI batch files)."""
    return OPENAI_ID_COLUMN if is_openai_batch(spec) else spec.input.id_column


def is_generating(spec: JobSpec) -> bool:
    """Whether the job generates text (task generate), rather than embedding or scoring (driver/pooled.py)."""
    return spec.task == "generate"


def has_json_valid(spec: JobSpec) -> bool:
    """Whether the job's rows can carry a JSON schema (the job's sampling, a per-row override column or OpenAI
    batch requests), so its output has the ``json_valid`` column."""
    can_have = spec.sampling.json_schema is not None or bool(spec.input.sampling_column) or is_openai_batch(spec)
    return can_have and is_generating(spec)


def has_reasoning(spec: JobSpec) -> bool:
    """Whether the job's output has the reasoning columns (a reasoning parser other than none)."""
    return spec.output.reasoning_parser != "none" and is_generating(spec)


def has_tools(spec: JobSpec) -> bool:
    """Whether the job's rows can carry tools (so its output has ``tool_calls`` and ``tool_call_warning``)."""
    return (bool(spec.input.tools) or bool(spec.input.tools_column) or is_openai_batch(spec)) and is_generating(spec)


def has_adapters(spec: JobSpec) -> bool:
    """Whether rows name a LoRA adapter (so the output has the ``adapter`` column)."""
    return bool(spec.input.adapter_column)


def job_output_schema(spec: JobSpec) -> pa.Schema:
    """The output row schema of this job (format, ``json_valid`` where rows can have a schema, the reasoning
    columns with a reasoning parser, the tool-call columns where rows can carry tools, an embed / score job's
    result columns, ``adapter`` where rows name an adapter, ``dedupe_of`` / ``output_fingerprint`` with
    output.dedupe prompts / outputs)."""
    return output_schema(spec.output.format, has_json_valid(spec), has_reasoning(spec), has_tools(spec),
                         output_task(spec), has_adapters(spec), spec.output.dedupe,
                         retries=spec.engine.backend == "openai", images=has_images(spec))


def request_columns(spec: JobSpec) -> list[str]:
    """The input columns a request is built from."""
    if is_openai_batch(spec):
        return list(OPENAI_COLUMNS)
    inp = spec.input
    cols = [inp.prompt_column, inp.messages_column, inp.id_column, inp.sampling_column, inp.system_prompt_column,
            inp.chat_template_kwargs_column, inp.tools_column, inp.completion_column, inp.adapter_column,
            inp.image_column, spec.sampling.seed_column, ROW_ERROR]
    return list(dict.fromkeys(c for c in cols if c))


def fingerprint_roles(spec: JobSpec) -> dict[str, str]:
    """Role -> input column of what a row's request is made of (its id left out): the columns its request
    fingerprint hashes (io/fingerprints.py)."""
    if is_openai_batch(spec):
        return {"method": "method", "url": "url", "body": "body"}
    inp = spec.input
    roles = {"prompt": inp.prompt_column, "messages": inp.messages_column, "sampling": inp.sampling_column,
             "system_prompt": inp.system_prompt_column, "chat_template_kwargs": inp.chat_template_kwargs_column,
             "tools": inp.tools_column, "seed": spec.sampling.seed_column, "image": inp.image_column}
    return {role: column for role, column in roles.items() if column}


def fingerprint_salt(spec: JobSpec) -> np.uint64:
    """The job's settings that shape every row's request (system prompt, chat template and its variables,
    tools, tool choice, input format), as the salt of each row's request fingerprint."""
    inp = spec.input
    shared = {"system_prompt": inp.system_prompt, "chat_template": inp.chat_template,
              "chat_template_kwargs": inp.chat_template_kwargs, "tools": inp.tools, "tool_choice": inp.tool_choice,
              "openai_batch": is_openai_batch(spec)}
    return text_salt(json.dumps(shared, sort_keys=True, default=str))


def row_fingerprints(spec: JobSpec, table: pa.Table, file_url: str = "",
                     prints: ImagePrints | None = None) -> dict[int, int]:
    """ROW_INDEX -> request fingerprint (as the signed int64 the output column holds) of a shard's input rows;
    ``prints`` (:func:`image_prints`, its digests filled by the worker's fetches) adds referenced images'
    content."""
    images = (lambda t: prints.row_hashes(t, file_url)) if prints is not None else None
    values = request_fingerprints(table, fingerprint_roles(spec), fingerprint_salt(spec), images).view(np.int64)
    return dict(zip(table.column(ROW_INDEX).to_pylist(), values.tolist(), strict=True))


def kept_columns(spec: JobSpec, available: list[str]) -> list[str]:
    """The input columns copied to output rows; ValueError names a kept column that clashes with an output
    column. '*' keeps every column of `available` except internal ones (`_`-prefixed) and the input column
    an output column of the same name is made from (the id column `id`, a `messages` chat in messages
    format)."""
    names = job_output_schema(spec).names
    keep = spec.output.keep_columns
    if keep == "*":
        sources = {id_column(spec)}
        if spec.output.format == "messages":
            sources.add(spec.input.messages_column)
        keep = [c for c in available if not c.startswith("_") and c != ROW_INDEX
                and not (c in names and c in sources)]
    clashes = [c for c in keep if c in names]
    if clashes:
        raise ValueError(f"output.keep_columns: input column(s) {', '.join(map(repr, clashes))} have the name of "
                         "an output column; rename them in the input or leave them out of keep_columns")
    return list(keep)


def read_shard_input(spec: JobSpec, file_url: str, row_start: int, row_end: int,
                     pin: dict[str, Any] | None = None) -> tuple[pa.Table, list[str]]:
    """A shard's input rows (any input format; the request columns, the kept columns, ROW_INDEX) and the
    names of the kept columns ('*' resolved against the file's columns). `pin`: the file's version at
    planning; a file rewritten since fails the read (io/reader.py: InputChanged) instead of mixing rows."""
    inp, keep = spec.input, spec.output.keep_columns
    wanted = None if keep == "*" else list(dict.fromkeys(request_columns(spec) + keep))
    table = read_input_rows(file_url, inp.storage_options, inp.format, row_start, row_end, wanted, pin)
    return table, kept_columns(spec, table.column_names)


def row_id(spec: JobSpec, file_stem: str, row: dict[str, Any]) -> tuple[str, str | None]:
    """The row's id and an error when the id column is null (the derived id is used then)."""
    derived = f"{file_stem}:{row[ROW_INDEX]}"
    column = id_column(spec)
    if column is None:
        return derived, None
    value = row.get(column)
    if value is None:
        return derived, f"id column {column!r} is null (row {derived})"
    return str(value), None


def to_request(spec: JobSpec, file_stem: str, row: dict[str, Any],
               sampling: SamplingParams | PoolingParams) -> RowRequest:
    """Build the request of one input row, or an error row; ``sampling`` is :func:`job_sampling` of ``spec``,
    or for an embed / score job its :func:`~jobrunner.driver.pooled.job_pooling`."""
    rid, id_error = row_id(spec, file_stem, row)
    # A text line that could not be read (ROW_ERROR names the line) is that row's error, whatever else.
    req = RowRequest(row_id=rid, row_index=row[ROW_INDEX], error=row.get(ROW_ERROR) or id_error)
    if is_openai_batch(spec):
        req.endpoint = "chat"
    if req.error:
        return req
    req.chat_template_kwargs = dict(spec.input.chat_template_kwargs) or None
    try:
        req.adapter = _row_adapter(spec, row, rid)
        if is_openai_batch(spec):
            _fill_openai(spec, req, row, sampling)
            req.num_images = check_count(req.prompt, spec.input.max_images_per_row)
        else:
            req.chat_template_kwargs = _template_kwargs(spec, row, req.chat_template_kwargs)
            req.prompt = _prompt(spec, row)
            req.num_images = check_count(req.prompt, spec.input.max_images_per_row)
            if isinstance(sampling, PoolingParams):
                req.params = row_pooling(spec, sampling, row)
                return req
            overrides = _row_overrides(spec, row)
            req.params = seeded(spec.sampling, _params(sampling, overrides, spec.input.sampling_column), row, rid,
                                "seed" in overrides)
            _give_tools(req, _row_tools(spec, row), spec.input.tool_choice)
    except ValueError as exc:
        req.prompt, req.params, req.error = None, None, str(exc)
    return req


def _fill_openai(spec: JobSpec, req: RowRequest, row: dict[str, Any],
                 sampling: SamplingParams | PoolingParams) -> None:
    parsed = parse_request(row.get("method"), row.get("url"), row.get("body"))
    req.endpoint, req.prompt = parsed.endpoint, parsed.prompt
    _check_line_model(spec, parsed.model)
    embedding = isinstance(sampling, PoolingParams)  # a task embed job
    if (parsed.endpoint == "embeddings") != embedding:
        why = "a task embed job reads /v1/embeddings lines only" if embedding else \
            "/v1/embeddings lines need the job's task: embed"
        raise ValueError(f"url {row.get('url')!r}: {why}")
    if embedding:
        req.params = sampling
        return
    if parsed.chat_template_kwargs:
        req.chat_template_kwargs = {**(req.chat_template_kwargs or {}), **parsed.chat_template_kwargs}
    req.params = seeded(spec.sampling, _params(sampling, parsed.overrides, None), row, req.row_id,
                        "seed" in parsed.overrides)
    if parsed.endpoint == "chat":
        _give_tools(req, parsed.tools, parsed.tool_choice)


def _check_line_model(spec: JobSpec, asked: str | None) -> None:
    """A line naming another model than the job's is refused (input.openai_model_mismatch: error, the default)
    or served by the job's model (warn: validate names such lines; the result line's `model` says who answered)."""
    why = model_mismatch(asked, spec.model.source)
    if why and spec.input.openai_model_mismatch == "error":
        raise ValueError(redact_text(f"{why}: name the job's model or none in the line, or set "
                                     "input.openai_model_mismatch: warn to serve it with the job's model"))


def _row_adapter(spec: JobSpec, row: dict[str, Any], rid: str) -> str | None:
    """The row's LoRA adapter (a key of model.adapters), None for the base model (no column, null or empty)."""
    column = spec.input.adapter_column
    value = row.get(column) if column else None
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError(f"adapter column {column!r} holds {type(value).__name__}, not an adapter name (row {rid})")
    if value not in spec.model.adapters:
        raise ValueError(f"adapter column {column!r}: unknown adapter {value!r} (row {rid}); model.adapters: "
                         f"{', '.join(spec.model.adapters)}")
    return value


def _prompt(spec: JobSpec, row: dict[str, Any]) -> str | list[dict[str, Any]]:
    """The row's prompt: its text or messages, with its image column's images first in its user message."""
    column = spec.input.image_column
    text_or_chat = _text_prompt(spec, row)
    return with_images(text_or_chat, column_refs(row.get(column), column)) if column else text_or_chat


def _text_prompt(spec: JobSpec, row: dict[str, Any]) -> str | list[dict[str, Any]]:
    system = _system_prompt(spec, row)
    if spec.input.prompt_column is not None:
        value = row.get(spec.input.prompt_column)
        if value is None or not str(value).strip():
            raise ValueError(f"prompt column {spec.input.prompt_column!r} is null or empty")
        if system is None:
            return str(value)
        return [{"role": "system", "content": system}, {"role": "user", "content": str(value)}]
    column = spec.input.messages_column
    try:
        messages = parse_messages(row.get(column))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"messages column {column!r}: {exc}") from None
    if system is None or messages[0].get("role") == "system":  # a row's own system message wins
        return messages
    return [{"role": "system", "content": system}, *messages]


def _system_prompt(spec: JobSpec, row: dict[str, Any]) -> str | None:
    """The row's system prompt: its column's value, else the job's ``input.system_prompt`` (None: no system
    message added)."""
    column = spec.input.system_prompt_column
    value = row.get(column) if column else None
    if value is not None and not isinstance(value, str):
        raise ValueError(f"system prompt column {column!r} holds {type(value).__name__}, not a string")
    return value if value and value.strip() else spec.input.system_prompt


def _row_tools(spec: JobSpec, row: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The row's tools: its column's (a JSON array or a list of structs), else the job's ``input.tools``."""
    column = spec.input.tools_column
    value = row.get(column) if column else None
    if value is None or value == "":
        return spec.input.tools
    try:
        value = json.loads(value) if isinstance(value, str) else value
    except ValueError as exc:
        raise ValueError(f"tools column {column!r} is not valid JSON ({exc})") from None
    return check_tools(value, f"tools column {column!r}")


def _give_tools(req: RowRequest, tools: list[dict[str, Any]] | None, tool_choice: Any) -> None:
    """Tools into the chat template (a raw prompt becomes one user turn), and a forced call through structured
    output when ``tool_choice`` is required or names a function."""
    if not tools or tool_choice == "none":
        return
    req.tools = list(tools)
    req.chat_template_kwargs = {**(req.chat_template_kwargs or {}), "tools": req.tools}
    if isinstance(req.prompt, str):
        req.prompt = [{"role": "user", "content": req.prompt}]
    schema = forced_call_schema(req.tools, tool_choice)
    if schema is not None:
        if req.params.is_structured:
            raise ValueError("tool_choice forces a call through structured output: the row cannot also set "
                             "json_schema, regex or choice")
        req.params, req.forced_tool = req.params.with_overrides({"json_schema": schema}), True


def _template_kwargs(spec: JobSpec, row: dict[str, Any], job: dict[str, Any] | None) -> dict[str, Any] | None:
    """The job's chat-template variables with the row's column (if any) merged over them."""
    column = spec.input.chat_template_kwargs_column
    if column is None:
        return job
    try:
        own = parse_overrides(row.get(column))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"chat template kwargs column {column!r}: {exc}") from None
    return {**(job or {}), **own} or None


def _row_overrides(spec: JobSpec, row: dict[str, Any]) -> dict[str, Any]:
    column = spec.input.sampling_column
    if column is None:
        return {}
    try:
        return parse_overrides(row.get(column))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"sampling column {column!r}: {exc}") from None


def job_sampling(spec: JobSpec) -> SamplingParams:
    """The job's sampling settings as the engine takes them, built once per job (the spec already checked them
    with the same call); a row's overrides are applied to it with :meth:`SamplingParams.with_overrides`."""
    return SamplingParams.from_dict(spec.sampling.engine_values())


def _params(base: SamplingParams, overrides: dict[str, Any], column: str | None) -> SamplingParams:
    try:
        return base.with_overrides(overrides)
    except (ValueError, TypeError) as exc:
        where = f"bad sampling override in column {column!r}" if column else "bad sampling settings"
        raise ValueError(f"{where}: {exc}") from None


def pooled_row(spec: JobSpec, req: RowRequest, out: Any) -> dict[str, Any]:
    """The output row of a finished embed / score request: the metric columns and the task's result columns
    (no text, no output tokens)."""
    metrics = out.metrics.to_dict()
    failed = out.finish_reason == "error"
    row = {"id": req.row_id, ROW_INDEX: req.row_index, "generated_text": None, "finish_reason": out.finish_reason,
           "error": out.error or ("engine error" if failed else None), "sample_index": 0, "prompt_shared": False,
           "logprobs": None, "prompt_logprobs": None, "adapter": req.adapter}
    for key in ("num_prompt_tokens", "num_cached_tokens", "num_output_tokens"):
        row[key] = int(metrics.get(key) or 0)
    for key in ("ttft_s", "itl_mean_s", "e2e_s", "queue_s"):
        row[key] = metrics.get(key)
    row.update(result_columns(output_task(spec), None if failed else out))
    return row


def error_row(req: RowRequest) -> dict[str, Any]:
    """The output row of a row that never reached the engine (one row, whatever n was asked): an error row, or
    a duplicate's row (finish_reason 'duplicate', no error)."""
    if req.dedupe_of is not None:
        return {"id": req.row_id, ROW_INDEX: req.row_index, "generated_text": None, "finish_reason": "duplicate",
                "error": None, "num_prompt_tokens": 0, "num_cached_tokens": 0, "num_output_tokens": 0,
                "sample_index": 0, "prompt_shared": False, "adapter": req.adapter, "dedupe_of": req.dedupe_of}
    return {"id": req.row_id, ROW_INDEX: req.row_index, "generated_text": None, "finish_reason": "error",
            "error": req.error, "num_prompt_tokens": 0, "num_cached_tokens": 0, "num_output_tokens": 0,
            "sample_index": 0, "prompt_shared": False, "adapter": req.adapter, "num_images": req.num_images,
            "num_image_tokens": 0}


def output_row(spec: JobSpec, req: RowRequest, out: Any, parser: Any = None,
               tool_parser: str | None = None) -> dict[str, Any]:
    """The output row of one finished sample of an engine request (a RequestOutput); ``parser`` (from
    :func:`jobrunner.driver.reasoning.choose_parser`) parts a reasoning trace from the answer, ``tool_parser``
    (:func:`jobrunner.driver.tool_calls.choose_tool_parser`) reads the calls of a row that carried tools."""
    if not is_generating(spec):
        return pooled_row(spec, req, out)
    metrics = out.metrics.to_dict()
    failed = out.finish_reason == "error"
    text = None if failed else out.text
    if has_reasoning(spec):
        split = None if failed or parser is None else parser.split(
            out.text, list(out.output_token_ids), list(getattr(out, "prompt_token_ids", None) or []))
        text = split.answer if split is not None else text
    calls = None
    given = None if failed else getattr(out, "tool_calls", None)  # an endpoint's own calls (backend openai)
    if given is not None and has_tools(spec):
        calls = given_tool_calls(given, text)
    elif has_tools(spec) and not failed and (req.forced_tool or (req.tools and tool_parser)):
        calls = parse_forced_call(text) if req.forced_tool else parse_tool_calls(tool_parser, text)
        text = calls.content if calls.calls else text
    reason = "tool_calls" if calls is not None and calls.calls and out.finish_reason == "stop" else out.finish_reason
    row = {"id": req.row_id, ROW_INDEX: req.row_index, "generated_text": text,
           "finish_reason": reason, "error": out.error or ("engine error" if failed else None),
           "sample_index": int(getattr(out, "sample_index", 0) or 0),
           "prompt_shared": bool(metrics.get("prompt_shared")),
           "logprobs": token_logprobs(getattr(out, "logprobs", None)),
           "prompt_logprobs": token_logprobs(getattr(out, "prompt_logprobs", None)), "adapter": req.adapter}
    for key in ("num_prompt_tokens", "num_cached_tokens", "num_output_tokens"):
        row[key] = int(metrics.get(key) or 0)
    for key in ("ttft_s", "itl_mean_s", "e2e_s", "queue_s"):
        row[key] = metrics.get(key)
    if spec.output.format == "messages" and not failed:
        row["messages"] = chat_of(req.prompt) + [{"role": "assistant", "content": text}]
    if has_json_valid(spec):
        row["json_valid"] = None if failed else json_valid(text, getattr(req.params, "json_schema", None))
    if has_reasoning(spec):
        row["reasoning"] = None if split is None else split.reasoning
        row["num_reasoning_tokens"] = None if split is None else split.num_reasoning_tokens
    if spec.engine.backend == "openai":
        row["num_retries"] = getattr(out, "num_retries", None)
    if has_images(spec):
        row["num_images"], row["num_image_tokens"] = req.num_images, image_tokens(out, metrics)
    if has_tools(spec):
        row["tool_calls"] = (endpoint_tool_calls(given) if given is not None else
                             openai_tool_calls(calls.calls, req.row_id, row["sample_index"])) \
            if calls is not None and calls.calls else None
        row["tool_call_warning"] = None if calls is None else calls.warning
    return row


def chat_of(prompt: Any) -> list[dict[str, Any]]:
    """A request's prompt as chat messages (a raw-text prompt is one user turn); a content of parts becomes
    text, an image as ``[image: <source>]`` (the output's messages column holds text)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        return [{**m, "content": parts_text(m["content"])} if isinstance(m.get("content"), list) else dict(m)
                for m in prompt]
    return [{"role": "user", "content": prompt if isinstance(prompt, str) else ""}]


def token_logprobs(entries: Any) -> list[dict[str, Any] | None] | None:
    """Engine TokenLogprob entries as plain dicts for the `logprobs` list column (None entries stay None)."""
    if entries is None:
        return None
    return [None if e is None else {
        "token_id": int(e.token_id), "token": e.token, "logprob": float(e.logprob),
        "token_bytes": getattr(e, "token_bytes", None),
        "top_logprobs": [{"token_id": int(t.token_id), "token": t.token, "logprob": float(t.logprob),
                          "token_bytes": getattr(t, "token_bytes", None)}
                         for t in (e.top_logprobs or ())]} for e in entries]


def prompt_tokens_once(rows: list[dict[str, Any]], key: str = "num_prompt_tokens") -> int:
    """Prompt (or cached) tokens of the rows, counting a prompt shared by sibling samples once."""
    return sum(int(r.get(key) or 0) for r in rows if not r.get("prompt_shared"))
