"""Prompt rows: as chats, as held-out text, and as token ids made once with the engine's tokenizer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PromptRow = str | list[dict[str, Any]]


def as_chat(row: PromptRow, raw: bool) -> PromptRow:
    """A ``prompt`` string becomes a single-turn user chat unless ``raw``; message lists stay as they are."""
    if isinstance(row, str) and not raw:
        return [{"role": "user", "content": row}]
    return row


def held_out_texts(rows: Sequence[PromptRow]) -> list[str]:
    """Perplexity text from prompt rows: every assistant turn of a chat row, the whole text of a plain row."""
    texts: list[str] = []
    for row in rows:
        if isinstance(row, str):
            texts.append(row)
        else:
            texts += [m["content"] for m in row if m.get("role") == "assistant" and m.get("content")]
    if not texts:
        raise ValueError("the quality texts have no assistant turns or prompt text to score")
    return texts


def tokenize_all(engine, rows: Sequence[PromptRow], raw: bool) -> list[list[int]]:
    """Token ids of every row, made by the engine's own ``tokenize`` (see :func:`as_chat`)."""
    return [engine.tokenize(as_chat(row, raw)) for row in rows]


def fit_to_context(token_ids: list[list[int]], max_tokens: int, max_model_len: int
                   ) -> tuple[list[list[int]], int]:
    """Drop prompts that cannot hold ``max_tokens`` more tokens in the context; return (kept, num_dropped)."""
    kept = [ids for ids in token_ids if ids and len(ids) + max_tokens <= max_model_len]
    return kept, len(token_ids) - len(kept)
