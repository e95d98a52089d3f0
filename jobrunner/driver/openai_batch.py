"""OpenAI batch files: a request line's body to a prompt and sampling overrides, and finished rows back to
OpenAI-style result lines (`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`).
A `/v1/embeddings` line (a task embed job) has one input and comes back as an embeddings response.

The body's sampling fields are honoured per row; a field we do not know (or cannot honour: `stream`, `tools`,
`echo`, several prompts) is that row's error, naming the field, so a request is never silently run with
different settings than it asked for.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from jobrunner.driver.tool_calls import check_tools
from jobrunner.io.image_parts import parse_content

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}
# Body fields copied to our sampling parameters under the same name (OpenAI's and vLLM's extras).
_SAME_NAME = ("max_tokens", "temperature", "top_p", "n", "seed", "presence_penalty", "frequency_penalty",
              "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
              "include_stop_str_in_output", "skip_special_tokens")
_RENAMED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
            "max_completion_tokens": "max_tokens"}
_IGNORED = ("model", "user", "metadata", "store", "service_tier")  # accepted, no effect on generation (model: checked
# against the job's model by driver/rows.py, input.openai_model_mismatch)
_HANDLED = {"chat": ("messages", "logprobs", "top_logprobs", "response_format", "chat_template_kwargs", "tools",
                     "tool_choice", "parallel_tool_calls"),
            "completions": ("prompt", "logprobs", "echo"),
            "embeddings": ("input", "encoding_format", "dimensions")}


@dataclass
class ParsedRequest:
    """What one request line asks for."""

    endpoint: str  # "chat", "completions" or "embeddings"
    prompt: str | list[int] | list[dict[str, Any]]
    overrides: dict[str, Any] = field(default_factory=dict)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    model: str | None = None  # body.model as written (None: the line names no model)


def parse_request(method: Any, url: Any, body_text: Any) -> ParsedRequest:
    """A request line's method, url and body (JSON text) as a prompt and sampling overrides; ValueError
    names the bad field."""
    if method not in (None, "POST"):
        raise ValueError(f"method {method!r}: only POST is supported")
    if url not in ENDPOINTS:
        raise ValueError(f"url {url!r}: must be one of {', '.join(ENDPOINTS)}")
    endpoint = ENDPOINTS[url]
    body = _body(body_text)
    parsed = _embedding_request(body) if endpoint == "embeddings" else _generation_request(endpoint, url, body)
    model = body.get("model")
    parsed.model = None if model is None or model == "" else str(model)
    return parsed


def model_mismatch(asked: str | None, source: str) -> str | None:
    """Why a line's body.model is not the job's model (``source``: model.source), None when it names none or
    the job's model: the source as written or its last path part (``org/name`` answers to ``name`` too)."""
    if asked is None or asked in (source, source.rstrip("/").rsplit("/", 1)[-1]):
        return None
    return f"body.model {asked!r} is not the job's model {source!r}"


def _generation_request(endpoint: str, url: str, body: dict[str, Any]) -> ParsedRequest:
    unknown = sorted(set(body) - set(_SAME_NAME) - set(_RENAMED) - set(_IGNORED) - set(_HANDLED[endpoint])
                     - {"stop", "logit_bias", "stream"})
    if unknown:
        raise ValueError(f"body field(s) {', '.join(unknown)} not supported for {url}")
    if body.get("stream"):
        raise ValueError("body.stream: streaming is not supported in a batch")
    overrides = _common_overrides(body)
    if endpoint == "chat":
        overrides.update(_chat_overrides(body))
        prompt: Any = _messages(body.get("messages"))
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError("body.chat_template_kwargs must be an object")
        tools = body.get("tools")
        if tools is not None:
            check_tools(tools, "body.tools")
        return ParsedRequest(endpoint, prompt, overrides, kwargs, tools, body.get("tool_choice"))
    if body.get("echo"):
        raise ValueError("body.echo: echoing the prompt is not supported")
    if body.get("logprobs") is not None:
        overrides["logprobs"] = body["logprobs"]
    return ParsedRequest(endpoint, _completion_prompt(body.get("prompt")), overrides)


def _embedding_request(body: dict[str, Any]) -> ParsedRequest:
    """A /v1/embeddings body: one input (a string or a list of token ids, alone or as a one-element list);
    float vectors of the model's own size (no sampling fields: the job's embed settings pool it)."""
    unknown = sorted(set(body) - set(_IGNORED) - set(_HANDLED["embeddings"]))
    if unknown:
        raise ValueError(f"body field(s) {', '.join(unknown)} not supported for /v1/embeddings")
    if body.get("encoding_format") not in (None, "float"):
        raise ValueError(f"body.encoding_format {body['encoding_format']!r}: only float is supported")
    if body.get("dimensions") is not None:
        raise ValueError("body.dimensions: shortened embeddings are not supported (the model's size is used)")
    value = body.get("input")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str) and value:
        return ParsedRequest("embeddings", value)
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return ParsedRequest("embeddings", value)
    raise ValueError("body.input must be one non-empty string or one list of token ids (one input per line)")


def _body(text: Any) -> dict[str, Any]:
    if text is None:
        raise ValueError("body is missing")
    try:
        body = json.loads(text) if isinstance(text, str) else text
    except ValueError as exc:
        raise ValueError(f"body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    return body


def _common_overrides(body: dict[str, Any]) -> dict[str, Any]:
    out = {k: body[k] for k in _SAME_NAME if body.get(k) is not None}
    out.update({ours: body[theirs] for theirs, ours in _RENAMED.items() if body.get(theirs) is not None})
    stop = body.get("stop")
    if stop is not None:
        out["stop"] = [stop] if isinstance(stop, str) else stop
    bias = body.get("logit_bias")
    if bias is not None:
        try:
            out["logit_bias"] = {int(k): float(v) for k, v in dict(bias).items()}
        except (TypeError, ValueError):
            raise ValueError("body.logit_bias must map token ids to numbers") from None
    return out


def _chat_overrides(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    top = body.get("top_logprobs")
    if body.get("logprobs"):
        out["logprobs"] = 0 if top is None else top
    elif top is not None:
        raise ValueError("body.top_logprobs needs body.logprobs: true")
    out.update(_response_format(body.get("response_format")))
    return out


def _response_format(fmt: Any) -> dict[str, Any]:
    if fmt is None:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ValueError("body.response_format.json_schema.schema must be a JSON schema object")
        return {"json_schema": schema}
    raise ValueError(f"body.response_format: type must be text, json_object or json_schema, got {fmt!r}")


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise ValueError("body.messages must be a non-empty list")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"body.messages[{i}] needs a string role")
        calls = m.get("tool_calls")
        content = None if calls and m.get("content") is None else _content(m.get("content"), i)
        message = {"role": m["role"], "content": content}
        message.update({k: m[k] for k in ("tool_calls", "tool_call_id", "name") if m.get(k) is not None})
        out.append(message)
    return out


def _content(content: Any, i: int) -> str | list[dict[str, Any]]:
    """A message's content: a string, or a list of text and image_url parts (text parts alone are joined with
    newlines; images stay parts that the worker fetches: io/image_parts.py)."""
    return parse_content(content, f"body.messages[{i}].content")


def _completion_prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    raise ValueError("body.prompt must be one non-empty string or one list of token ids")


# ---- results ------------------------------------------------------------------------------------------

def result_lines(rows: list[dict[str, Any]], endpoint_of: dict[str, str], model: str, job: str,
                 created: int | None = None, unnamed: set[str] | frozenset[str] = frozenset(),
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The output lines and error lines of the rows (one line per custom_id, samples as choices; custom_ids
    are unique: planning refuses a batch that repeats one). `unnamed`: row ids of lines whose custom_id could
    not be read; their error line has `custom_id: null` (its message names the line)."""
    created = int(time.time()) if created is None else created
    by_id: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_id.setdefault(row["id"], []).append(row)
    outputs, errors = [], []
    for custom_id, samples in by_id.items():
        samples.sort(key=lambda r: r.get("sample_index") or 0)
        digest = hashlib.sha1(f"{job}\0{custom_id}".encode()).hexdigest()[:24]
        failed = next((r for r in samples if r.get("error") is not None), None)
        if failed is not None:
            shown = None if custom_id in unnamed else custom_id
            errors.append(_line(digest, shown, failed.get("_status") or 500, _error_body(failed)))
        else:
            body = _completion(samples, endpoint_of.get(custom_id, "chat"), model, digest, created)
            outputs.append(_line(digest, custom_id, 200, body))
    return outputs, errors


def _line(digest: str, custom_id: str | None, status: int, body: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"batch_req_{digest}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"req_{digest}", "body": body}, "error": None}


def _error_body(row: dict[str, Any]) -> dict[str, Any]:
    kind = "invalid_request_error" if row.get("_status") == 400 else "server_error"
    return {"error": {"message": row.get("error") or "error", "type": kind, "param": None, "code": None}}


def _embedding(row: dict[str, Any], model: str) -> dict[str, Any]:
    """An OpenAI embeddings response body for one input."""
    tokens = int(row.get("num_prompt_tokens") or 0)
    return {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": row.get("embedding")}],
            "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _completion(samples: list[dict[str, Any]], endpoint: str, model: str, digest: str,
                created: int) -> dict[str, Any]:
    if endpoint == "embeddings":
        return _embedding(samples[0], model)
    prompt_tokens = max(int(r.get("num_prompt_tokens") or 0) for r in samples)
    completion_tokens = sum(int(r.get("num_output_tokens") or 0) for r in samples)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    if any(r.get("num_reasoning_tokens") is not None for r in samples):  # a job with a reasoning parser
        usage["completion_tokens_details"] = {
            "reasoning_tokens": sum(int(r.get("num_reasoning_tokens") or 0) for r in samples)}
    if endpoint == "chat":
        choices = [_chat_choice(r) for r in samples]
        return {"id": f"chatcmpl-{digest}", "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage}
    choices = [_text_choice(r) for r in samples]
    return {"id": f"cmpl-{digest}", "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage}


def _chat_choice(row: dict[str, Any]) -> dict[str, Any]:
    logprobs = row.get("logprobs")
    content = None if logprobs is None else [_chat_token(e) for e in logprobs if e is not None]
    message = {"role": "assistant", "content": row["generated_text"]}
    if row.get("reasoning") is not None:
        message["reasoning_content"] = row["reasoning"]
    if row.get("tool_calls"):
        message["tool_calls"] = row["tool_calls"]
    return {"index": row.get("sample_index") or 0, "finish_reason": row["finish_reason"],
            "message": message,
            "logprobs": None if content is None else {"content": content}}


def _chat_token(entry: dict[str, Any]) -> dict[str, Any]:
    return {"token": entry["token"], "logprob": entry["logprob"], "bytes": _token_bytes(entry),
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": _token_bytes(t)}
                             for t in entry["top_logprobs"]]}


def _token_bytes(entry: dict[str, Any]) -> list[int]:
    """OpenAI's `bytes`: the token's raw bytes as the engine recorded them (a piece of a multi-byte character
    has its own bytes, not those of U+FFFD); the UTF-8 of the token text for parts written without them."""
    raw = entry.get("token_bytes")
    return list(raw) if raw is not None else list(entry["token"].encode())


def _text_choice(row: dict[str, Any]) -> dict[str, Any]:
    logprobs = row.get("logprobs")
    return {"index": row.get("sample_index") or 0, "text": row["generated_text"],
            "finish_reason": row["finish_reason"],
            "logprobs": None if logprobs is None else _text_logprobs([e for e in logprobs if e is not None])}


def _text_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    offsets, offset = [], 0
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}
