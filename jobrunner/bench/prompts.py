"""Turn prompt rows into token ids once, with the engine's tokenizer, for both our engine and the baseline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PromptRow = str | list[dict[str, Any]]


def as_chat(row: PromptRow, raw: bool) -> PromptRow:
    """A ``prompt`` string becomes a single-turn user chat unless ``raw``; message lists stay as they are."""
    if isinstance(row, str) and not raw:
        return [{"role": "user", "content": row}]
    return row


def tokenize(tokenizer, row: PromptRow) -> list[int]:
    """Token ids exactly as the engine makes them: raw text with special tokens, chats through the template."""
    if isinstance(row, str):
        return list(tokenizer(row)["input_ids"])
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the model's tokenizer has no chat template; pass --raw-prompts to send raw text")
    text = tokenizer.apply_chat_template(row, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_all(tokenizer, rows: Sequence[PromptRow], raw: bool) -> list[list[int]]:
    """Token ids of every row (see :func:`as_chat` and :func:`tokenize`)."""
    return [tokenize(tokenizer, as_chat(row, raw)) for row in rows]


def fit_to_context(token_ids: list[list[int]], max_tokens: int, max_model_len: int
                   ) -> tuple[list[list[int]], int]:
    """Drop prompts that cannot hold ``max_tokens`` more tokens in the context; return (kept, num_dropped)."""
    kept = [ids for ids in token_ids if ids and len(ids) + max_tokens <= max_model_len]
    return kept, len(token_ids) - len(kept)
