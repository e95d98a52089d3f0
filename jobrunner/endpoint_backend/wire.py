"""A request as an OpenAI-compatible endpoint takes it, and its answer as our RequestOutputs.

Chat messages go to ``/chat/completions`` (their images as ``image_url`` parts holding ``data:`` URLs), raw text
and token ids to ``/completions``. Every sampling field of
ours has an OpenAI field or one of vLLM's extra fields; a field is sent only when it differs from its default,
so a hosted API is asked only for what it knows (one that refuses a field answers 400, and the row's error says
so). The endpoint gives text, not token ids: ``output_token_ids`` are empty and token counts come from the
usage it reports; logprob entries carry ``token_id`` -1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from jobrunner.engine.request import TokenLogprob, TopLogprob
from jobrunner.engine.sampling_params import SamplingParams

# vLLM's extra sampling fields (its OpenAI server takes them beside OpenAI's): sent only when not the default
_EXTRA_FIELDS = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "ignore_eos": False,
                 "include_stop_str_in_output": False, "skip_special_tokens": True}


@dataclass
class Choice:
    """One sample of an answer: its text and what came with it."""

    index: int
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning: str | None = None


@dataclass
class Answer:
    """A parsed answer: its samples (by index) and the usage the server reports (None when it does not)."""

    choices: list[Choice] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int = 0


def is_chat(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def request_body(model: str, prompt: Any, params: SamplingParams,
                 chat_template_kwargs: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """(path under the base URL, JSON body) of one request; ValueError for a prompt of no known shape."""
    chat = is_chat(prompt)
    if chat:
        body: dict[str, Any] = {"model": model, "messages": wire_messages(prompt)}
    elif isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt)):
        body = {"model": model, "prompt": prompt if isinstance(prompt, str) else list(prompt)}
    else:
        raise ValueError(f"a prompt of type {type(prompt).__name__} is neither text, token ids nor chat messages")
    body.update(_sampling_fields(params, chat))
    kwargs = dict(chat_template_kwargs or {})
    tools = kwargs.pop("tools", None)
    if tools and chat:
        body["tools"] = tools
    if kwargs and chat:
        body["chat_template_kwargs"] = kwargs  # vLLM's field (e.g. enable_thinking)
    return ("/chat/completions" if chat else "/completions"), body


def wire_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages as the endpoint takes them: each image part (``{"type": "image", "image": ImageInput}``,
    engine/images.py) becomes OpenAI's ``{"type": "image_url", "image_url": {"url": <data: URL>}}``; every
    other part and message is sent as it is."""
    return [_wire_message(m) for m in messages]


def _wire_message(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if not isinstance(content, list):
        return dict(message)
    parts = [{"type": "image_url", "image_url": {"url": p["image"].data_url()}}
             if isinstance(p, dict) and p.get("type") == "image" else p for p in content]
    return {**message, "content": parts}


def without_images(messages: Any) -> Any:
    """The prompt with its image parts left out (what the token estimate reads beside the images' own)."""
    if not is_chat(messages):
        return messages
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            message = {**message, "content": [p for p in content
                                              if not (isinstance(p, dict) and p.get("type") == "image")]}
        out.append(message)
    return out


IMAGE_TILE_PX = 512  # an image's tokens are estimated per 512-pixel tile, as OpenAI prices a detailed image
IMAGE_TOKENS_PER_TILE = 170
IMAGE_TOKENS_BASE = 85


def image_tokens_estimate(size: tuple[int, int]) -> int:
    """Tokens an image of ``size`` (width, height) is estimated to take before the endpoint reports its usage:
    85 + 170 per 512-pixel tile (OpenAI's published rule for a detailed image, without its rescaling)."""
    width, height = size
    tiles = -(-max(1, width) // IMAGE_TILE_PX) * -(-max(1, height) // IMAGE_TILE_PX)
    return IMAGE_TOKENS_BASE + IMAGE_TOKENS_PER_TILE * tiles


def _sampling_fields(params: SamplingParams, chat: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"max_tokens": params.max_tokens, "temperature": params.temperature}
    if params.top_p != 1.0:
        out["top_p"] = params.top_p
    if params.n != 1:
        out["n"] = params.n
    if params.seed is not None:
        out["seed"] = params.seed
    if params.stop:
        out["stop"] = list(params.stop)
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(params, name):
            out[name] = getattr(params, name)
    if params.logit_bias:
        out["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    for name, default in _EXTRA_FIELDS.items():
        if getattr(params, name) != default:
            out[name] = getattr(params, name)
    if params.logprobs is not None:
        out.update({"logprobs": True, "top_logprobs": params.logprobs} if chat else {"logprobs": params.logprobs})
    if params.prompt_logprobs is not None:
        out["prompt_logprobs"] = params.prompt_logprobs  # vLLM's field; read back only by vLLM
    if params.json_schema is not None:
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "row", "schema": params.json_schema}}
    elif params.regex is not None:
        out["structured_outputs"] = {"regex": params.regex}  # vLLM's field
    elif params.choice is not None:
        out["structured_outputs"] = {"choice": list(params.choice)}
    return out


def parse_answer(data: dict[str, Any]) -> Answer:
    """The server's JSON answer (chat or completion) as an Answer; ValueError when it has no choices."""
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        raise ValueError(f"the answer holds no choices: {json.dumps(data)[:300]}")
    answer = Answer(choices=sorted((_choice(c, i) for i, c in enumerate(choices)), key=lambda c: c.index))
    usage = data.get("usage") or {}
    if isinstance(usage, dict):
        answer.prompt_tokens = _int(usage.get("prompt_tokens"))
        answer.completion_tokens = _int(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details") or {}
        answer.cached_tokens = _int(details.get("cached_tokens") if isinstance(details, dict) else None) or 0
    return answer


def _choice(raw: dict[str, Any], position: int) -> Choice:
    index = _int(raw.get("index"))
    message = raw.get("message")
    if isinstance(message, dict):  # chat
        text = message.get("content") or ""
        calls = message.get("tool_calls") or None
        reasoning = message.get("reasoning_content") or message.get("reasoning") or None
        logprobs = _chat_logprobs(raw.get("logprobs"))
    else:
        text, calls, reasoning = raw.get("text") or "", None, None
        logprobs = _completion_logprobs(raw.get("logprobs"))
    return Choice(index=position if index is None else index, text=text,
                  finish_reason=str(raw.get("finish_reason") or "length"), logprobs=logprobs, tool_calls=calls,
                  reasoning=reasoning)


def _chat_logprobs(raw: Any) -> list[TokenLogprob] | None:
    """Chat's ``logprobs.content``: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
    content = raw.get("content") if isinstance(raw, dict) else None
    if not isinstance(content, list):
        return None
    return [TokenLogprob(token_id=-1, token=str(e.get("token", "")), logprob=float(e.get("logprob", 0.0)),
                         top_logprobs=[TopLogprob(-1, str(t.get("token", "")), float(t.get("logprob", 0.0)),
                                                  _bytes(t.get("bytes"), t.get("token")))
                                       for t in e.get("top_logprobs") or ()],
                         token_bytes=_bytes(e.get("bytes"), e.get("token")))
            for e in content]


def _completion_logprobs(raw: Any) -> list[TokenLogprob] | None:
    """Completions' ``logprobs``: {tokens: [...], token_logprobs: [...], top_logprobs: [{token: logprob}]}."""
    if not isinstance(raw, dict) or not isinstance(raw.get("tokens"), list):
        return None
    tops = raw.get("top_logprobs") or [None] * len(raw["tokens"])
    entries = []
    for token, logprob, top in zip(raw["tokens"], raw.get("token_logprobs") or (), tops, strict=False):
        alternatives = sorted((top or {}).items(), key=lambda kv: -kv[1])
        entries.append(TokenLogprob(token_id=-1, token=str(token), logprob=float(logprob or 0.0),
                                    top_logprobs=[TopLogprob(-1, str(t), float(lp), str(t).encode())
                                                  for t, lp in alternatives],
                                    token_bytes=str(token).encode()))
    return entries


def _bytes(raw: Any, token: Any) -> bytes:
    if isinstance(raw, list) and all(isinstance(b, int) for b in raw):
        return bytes(raw)
    return str(token or "").encode()


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def error_message(body: bytes) -> str:
    """The server's own message from an error answer (OpenAI's {"error": {"message"}}, or the text)."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:300]
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])[:300]
    for name in ("message", "detail"):  # FastAPI's own 404 is {"detail": "Not Found"}
        if isinstance(data, dict) and isinstance(data.get(name), str) and data[name]:
            return data[name][:300]
    return text[:300]


def assemble_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed answer's chunks (`data:` events, in order) as the one answer a non-streamed request gets:
    each choice's text (or message content, reasoning and tool calls, merged by their index), its logprobs,
    its last finish reason, and the usage of the final chunk."""
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for event in events:
        if isinstance(event.get("error"), dict):
            raise ValueError(f"the stream ended with an error: {event['error'].get('message')}")
        usage = event.get("usage") or usage
        for chunk in event.get("choices") or ():
            _merge_chunk(choices.setdefault(int(chunk.get("index") or 0), {}), chunk)
    return {"choices": [_finished_choice(i, c) for i, c in sorted(choices.items())], "usage": usage}


def _merge_chunk(into: dict[str, Any], chunk: dict[str, Any]) -> None:
    delta = chunk.get("delta")
    if isinstance(delta, dict):  # chat
        into["chat"] = True
        for key in ("content", "reasoning_content", "reasoning"):
            if delta.get(key):
                into[key] = into.get(key, "") + delta[key]
        for call in delta.get("tool_calls") or ():
            slot = into.setdefault("tool_calls", {}).setdefault(int(call.get("index") or 0), {
                "id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            slot["id"] = call.get("id") or slot["id"]
            function = call.get("function") or {}
            slot["function"]["name"] += function.get("name") or ""
            slot["function"]["arguments"] += function.get("arguments") or ""
        content = (chunk.get("logprobs") or {}).get("content") if isinstance(chunk.get("logprobs"), dict) else None
        if content:
            into.setdefault("logprob_content", []).extend(content)
    else:
        into["text"] = into.get("text", "") + (chunk.get("text") or "")
        logprobs = chunk.get("logprobs")
        if isinstance(logprobs, dict):
            for key in ("tokens", "token_logprobs", "top_logprobs"):
                into.setdefault(key, []).extend(logprobs.get(key) or ())
    if chunk.get("finish_reason"):
        into["finish_reason"] = chunk["finish_reason"]


def _finished_choice(index: int, merged: dict[str, Any]) -> dict[str, Any]:
    reason = merged.get("finish_reason")
    if merged.get("chat"):
        calls = [merged["tool_calls"][i] for i in sorted(merged.get("tool_calls") or {})] or None
        logprobs = {"content": merged["logprob_content"]} if "logprob_content" in merged else None
        return {"index": index, "finish_reason": reason, "logprobs": logprobs,
                "message": {"content": merged.get("content", ""), "tool_calls": calls,
                            "reasoning_content": merged.get("reasoning_content") or merged.get("reasoning")}}
    logprobs = ({key: merged.get(key, []) for key in ("tokens", "token_logprobs", "top_logprobs")}
                if "tokens" in merged else None)
    return {"index": index, "finish_reason": reason, "text": merged.get("text", ""), "logprobs": logprobs}
