"""Reasoning traces apart from answers: ``output.reasoning_parser`` (auto | none | think_tags | harmony).

Reasoning models write a trace before the answer. A dataset wants the two apart, so a job with a parser writes
the answer in ``generated_text``, the trace in ``reasoning`` and its length in ``num_reasoning_tokens``:

- ``think_tags`` (Qwen3, DeepSeek-R1 and its distills, QwQ...): the trace is what precedes ``</think>``, with
  a leading ``<think>`` dropped; the chat template may already have opened the block at the end of the prompt
  (R1 distills do), so the output holds only its end. A block that never closes within ``max_tokens`` is all
  trace: ``reasoning`` keeps it, the answer is empty (finish reason ``length``). Output without tags and
  without an opened block is all answer (Qwen3 with ``enable_thinking: false``).
- ``harmony`` (gpt-oss): channels in the raw token stream, ``<|channel|>analysis<|message|>…<|end|>`` then
  ``<|start|>assistant<|channel|>final<|message|>…``; the ``analysis`` (and ``commentary``) messages are the
  trace, the ``final`` message the answer. Its markers are special tokens, so the output ids are decoded again
  with special tokens kept.
- ``auto``: from the model's chat template — ``<|channel|>`` means harmony, ``<think>`` means think_tags, else
  no parser (the columns stay null).

The reasoning token count is the generated ids up to and including the closing marker: found as its token id
where the marker is one token of the vocabulary, else as the fewest leading ids whose text holds it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

PARSERS = ("auto", "none", "think_tags", "harmony")
OPEN_THINK, CLOSE_THINK = "<think>", "</think>"
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)[^<]*<\|message\|>(.*?)(?=<\|end\|>|<\|return\|>|<\|call\|>|"
                      r"<\|start\|>|<\|channel\|>|$)", re.S)


@dataclass(frozen=True)
class Split:
    """One sample's text, parted."""

    reasoning: str | None  # None: no trace in this sample
    answer: str
    num_reasoning_tokens: int


class ThinkTags:
    """``<think>`` … ``</think>`` then the answer."""

    name = "think_tags"

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.close_id = _single_token_id(tokenizer, CLOSE_THINK)

    def split(self, text: str, output_ids: list[int], prompt_ids: list[int] | None = None) -> Split:
        """Part ``text`` (the decoded output) into trace and answer; ``prompt_ids`` tell whether the template
        opened the block already."""
        body = text.lstrip()
        opened_here = body.startswith(OPEN_THINK)
        if opened_here:
            body = body[len(OPEN_THINK):]
        closed = CLOSE_THINK in body
        if not closed and not (opened_here or self._prompt_opened(prompt_ids)):
            return Split(None, text, 0)  # no block: all answer
        trace, _, answer = body.partition(CLOSE_THINK)
        count = self._count(trace, output_ids, closed)
        return Split(trace.strip(), answer.strip(), count)

    def _prompt_opened(self, prompt_ids: list[int] | None) -> bool:
        if not prompt_ids or self.tokenizer is None:
            return False
        tail = self.tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
        return tail.rfind(OPEN_THINK) > tail.rfind(CLOSE_THINK)

    def _count(self, trace: str, output_ids: list[int], closed: bool) -> int:
        if not closed:
            return len(output_ids)  # never closed: every generated token is trace
        if self.close_id is not None and self.close_id in output_ids:
            return output_ids.index(self.close_id) + 1
        end = _tokens_until(self.tokenizer, output_ids, CLOSE_THINK, skip_special=True)
        return end if end is not None else _token_count(self.tokenizer, trace)


class Harmony:
    """gpt-oss's channels: ``analysis`` / ``commentary`` are the trace, ``final`` the answer."""

    name = "harmony"

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.final_ids = _ids(tokenizer, "<|channel|>final")

    def split(self, text: str, output_ids: list[int], prompt_ids: list[int] | None = None) -> Split:
        """Part the raw token stream (decoded with its markers) into channels."""
        raw = self.tokenizer.decode(output_ids, skip_special_tokens=False) if self.tokenizer is not None else text
        if "<|channel|>" not in raw and "<|message|>" not in raw:
            return Split(None, text, 0)
        trace, answer, final_seen = [], [], False
        for channel, body in _CHANNEL.findall(raw):
            if channel == "final":
                answer.append(body)
                final_seen = True
            else:
                trace.append(body)
        reasoning = "\n".join(t.strip() for t in trace) if trace else None
        count = self._count(output_ids, final_seen, reasoning)
        return Split(reasoning, "".join(answer).strip(), count)

    def _count(self, output_ids: list[int], final_seen: bool, reasoning: str | None) -> int:
        if not final_seen:
            return len(output_ids)
        start = _find(output_ids, self.final_ids)
        if start is not None:
            return start
        end = _tokens_until(self.tokenizer, output_ids, "<|channel|>final", skip_special=False)
        return end if end is not None else _token_count(self.tokenizer, reasoning or "")


def choose_parser(name: str, tokenizer: Any = None, chat_template: str | None = None) -> ThinkTags | Harmony | None:
    """The parser ``output.reasoning_parser`` names; ``auto`` reads the chat template (the job's, else the
    tokenizer's). None: no parsing."""
    if name not in PARSERS:
        raise ValueError(f"output.reasoning_parser: unknown parser {name!r}; choose {'|'.join(PARSERS)}")
    if name == "auto":
        template = chat_template or getattr(tokenizer, "chat_template", None) or ""
        template = template if isinstance(template, str) else " ".join(str(t) for t in template)
        name = "harmony" if "<|channel|>" in template else "think_tags" if OPEN_THINK in template else "none"
    return {"think_tags": ThinkTags, "harmony": Harmony}.get(name, lambda _t: None)(tokenizer)


def _single_token_id(tokenizer: Any, text: str) -> int | None:
    ids = _ids(tokenizer, text)
    return ids[0] if ids is not None and len(ids) == 1 else None


def _ids(tokenizer: Any, text: str) -> list[int] | None:
    if tokenizer is None:
        return None
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode the marker: count by text instead
        return None


def _find(haystack: list[int], needle: list[int] | None) -> int | None:
    if not needle:
        return None
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i:i + len(needle)] == needle:
            return i
    return None


def _tokens_until(tokenizer: Any, ids: list[int], marker: str, skip_special: bool) -> int | None:
    """The fewest leading ``ids`` whose text holds ``marker`` (a marker written as several tokens: counted in
    the ids the model generated, by bisection over decoded prefixes); None without a tokenizer or marker."""
    if tokenizer is None:
        return None

    def holds(k: int) -> bool:
        return marker in tokenizer.decode(ids[:k], skip_special_tokens=skip_special)

    if not holds(len(ids)):
        return None
    low, high = 0, len(ids)  # holds(high), not holds(low)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if holds(middle) else (middle, high)
    return high


def _token_count(tokenizer: Any, text: str) -> int:
    ids = _ids(tokenizer, text) if text else []
    return len(ids) if ids is not None else len(text.split())
