"""Tool calls in generated text, as OpenAI's ``tool_calls``: ``output.tool_call_parser`` (auto | none | hermes |
llama3_json).

Rows that carry tools (``input.tools``, ``input.tools_column``, an OpenAI batch body's ``tools``) get them in the
chat template (the ``tools`` variable that Qwen, Hermes, Llama 3.1 and Mistral templates read); what the model
writes back is parsed per the model's convention:

- ``hermes`` (Qwen2.5 / Qwen3, Hermes, many fine-tunes): each call a JSON object ``{"name": ..., "arguments":
  {...}}`` between ``<tool_call>`` and ``</tool_call>``; the text outside the blocks is the message content.
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): the whole reply is one JSON call ``{"name": ..., "parameters": {...}}``
  (or several joined by ``;``), optionally after ``<|python_tag|>``.
- ``auto``: from the chat template (``<tool_call>`` means hermes; ``<|python_tag|>`` or Llama's ``Environment:
  ipython`` means llama3_json), else no parsing.

A parsed reply has ``tool_calls`` (each with a stable id derived from the row id, sample and position, so a
rerun writes the same ids) and finish reason ``tool_calls``; a call that does not parse leaves the whole reply
as text, no calls, and says why in ``tool_call_warning`` — never an error row.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

PARSERS = ("auto", "none", "hermes", "llama3_json")
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCallParse:
    """One reply, parsed."""

    content: str | None  # the text outside the calls (None when nothing is left)
    calls: list[dict[str, Any]]  # [{"name": str, "arguments": JSON text}]
    warning: str | None = None


def check_tools(tools: Any, where: str) -> list[dict[str, Any]]:
    """``tools`` as OpenAI writes them (a list of ``{type: function, function: {name, ...}}``), or ValueError
    naming ``where`` and the bad entry."""
    if not isinstance(tools, list):
        raise ValueError(f"{where} must be a list of tool objects")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"{where}[{i}] must be {{type: function, function: {{name, description, parameters}}}}")
    return tools


def choose_tool_parser(name: str, tokenizer: Any = None, chat_template: str | None = None) -> str | None:
    """The parser ``output.tool_call_parser`` names (``auto``: read from the chat template); None: none."""
    if name not in PARSERS:
        raise ValueError(f"output.tool_call_parser: unknown parser {name!r}; choose {'|'.join(PARSERS)}")
    if name != "auto":
        return None if name == "none" else name
    template = chat_template or getattr(tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else " ".join(str(t) for t in template)
    if "<tool_call>" in template:
        return "hermes"
    if _PYTHON_TAG in template or "Environment: ipython" in template:
        return "llama3_json"
    return None


def parse_tool_calls(parser: str | None, text: str) -> ToolCallParse:
    """Split ``text`` into content and calls per ``parser``; a malformed call keeps the text whole."""
    if parser == "hermes":
        return _hermes(text)
    if parser == "llama3_json":
        return _llama3(text)
    return ToolCallParse(text, [])


def _hermes(text: str) -> ToolCallParse:
    blocks = _HERMES_BLOCK.findall(text)
    if not blocks:
        return ToolCallParse(text, [])
    calls = []
    for i, block in enumerate(blocks):
        call, problem = _call(block, ("arguments", "parameters"))
        if problem:
            return ToolCallParse(text, [], f"tool call {i + 1} {problem}; the reply is kept as text")
        calls.append(call)
    content = _HERMES_BLOCK.sub("", text).strip()
    return ToolCallParse(content or None, calls)


def _llama3(text: str) -> ToolCallParse:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return ToolCallParse(text, [])  # an ordinary answer
    calls = []
    for i, part in enumerate(_split_json_objects(body)):
        call, problem = _call(part, ("parameters", "arguments"))
        if problem:
            return ToolCallParse(text, [], f"tool call {i + 1} {problem}; the reply is kept as text")
        calls.append(call)
    return ToolCallParse(None, calls)


def _split_json_objects(body: str) -> list[str]:
    """``{...}; {...}`` as its objects (a single object is the common case)."""
    decoder, parts, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            _, end = decoder.raw_decode(body, at)
        except ValueError:
            return parts + [body[at:]]  # the rest does not parse: _call says why
        parts.append(body[at:end])
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return parts


def _call(text: str, argument_keys: tuple[str, ...]) -> tuple[dict[str, Any], str | None]:
    try:
        value = json.loads(text.strip())
    except ValueError as exc:
        return {}, f"is not valid JSON ({exc})"
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return {}, "has no function name"
    arguments = next((value[k] for k in argument_keys if k in value), {})
    if isinstance(arguments, str):  # already JSON text (some models write it so)
        try:
            json.loads(arguments)
        except ValueError:
            return {}, "has arguments that are not JSON"
        return {"name": value["name"], "arguments": arguments}, None
    if not isinstance(arguments, dict):
        return {}, "has arguments that are not a JSON object"
    return {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}, None


def openai_tool_calls(calls: list[dict[str, Any]], row_id: str, sample_index: int) -> list[dict[str, Any]]:
    """The calls in OpenAI's form, ids stable across reruns (from the row id, the sample and the position)."""
    out = []
    for i, call in enumerate(calls):
        digest = hashlib.sha256(f"{row_id}\x00{sample_index}\x00{i}".encode()).hexdigest()[:24]
        out.append({"id": f"call_{digest}", "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]}})
    return out


def forced_call_schema(tools: list[dict[str, Any]], tool_choice: Any) -> dict[str, Any] | None:
    """The JSON schema that makes the model write a call when ``tool_choice`` is ``required`` or names a
    function (structured output: the reply is the call's JSON, ``{"name": ..., "arguments": {...}}``); None for
    ``auto`` / ``none`` / absent. ValueError names a choice that matches no tool."""
    if tool_choice in (None, "auto", "none"):
        return None
    functions = [t.get("function") or {} for t in tools if isinstance(t, dict)]
    if tool_choice == "required":
        chosen = functions
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        chosen = [f for f in functions if f.get("name") == name]
        if not chosen:
            raise ValueError(f"tool_choice names function {name!r}, which is not among the tools")
    else:
        raise ValueError(f"tool_choice must be auto, none, required or {{type: function, function: {{name}}}}, "
                         f"got {tool_choice!r}")
    options = [{"type": "object", "properties": {"name": {"const": f.get("name")},
                                                 "arguments": f.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False} for f in chosen]
    if not options:
        raise ValueError("tool_choice is required but the row has no tools")
    return options[0] if len(options) == 1 else {"anyOf": options}


def parse_forced_call(text: str) -> ToolCallParse:
    """A reply written under :func:`forced_call_schema`: the whole text is one call."""
    call, problem = _call(text, ("arguments",))
    if problem:
        return ToolCallParse(text, [], f"forced tool call {problem}; the reply is kept as text")
    return ToolCallParse(None, [call])


def given_tool_calls(given: Any, text: str | None) -> ToolCallParse:
    """The calls an endpoint returned itself (engine.backend openai: OpenAI's message.tool_calls) as a parse:
    the reply's text is its content; each call's id is the endpoint's own."""
    calls = [{"name": str((c.get("function") or {}).get("name") or ""),
              "arguments": _arguments_text((c.get("function") or {}).get("arguments"))}
             for c in given or () if isinstance(c, dict)]
    return ToolCallParse(content=text or None, calls=calls)


def endpoint_tool_calls(given: Any) -> list[dict[str, Any]]:
    """An endpoint's calls in the output column's shape (id, type, function {name, arguments as JSON text})."""
    return [{"id": str(c.get("id") or ""), "type": str(c.get("type") or "function"),
             "function": {"name": str((c.get("function") or {}).get("name") or ""),
                          "arguments": _arguments_text((c.get("function") or {}).get("arguments"))}}
            for c in given or () if isinstance(c, dict)]


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {})
