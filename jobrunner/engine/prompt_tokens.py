"""A prompt's token ids as the engine makes them: raw text with the tokenizer's special tokens, chat messages
through the chat template with the generation prompt. Shared by the engine and by `jobrunner validate`, which
counts prompt lengths with the same rule before any worker starts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def text_or_chat_token_ids(tokenizer: Any, prompt: str | Sequence[dict[str, Any]], chat_template: str | None = None,
                           chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of raw text (``prompt`` a str) or of chat messages (a list of ``{role, content}`` dicts)."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"]) if prompt else []
    text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True,
                                         chat_template=chat_template, **(chat_template_kwargs or {}))
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
