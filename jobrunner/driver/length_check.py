"""`jobrunner validate`'s prompt-length check: the input's rows made into prompts as a worker makes them,
tokenized with the model's own tokenizer, against the context a worker will have (prompt + max_tokens).

Only a tokenizer already on this machine is used (a local model directory, or an alias or source that
`jobrunner fetch` put in the cache): validate never downloads weights. The rows are those the row check read
(driver/row_check.py: at most MAX_ROWS, the first rows of each file in turn), so the check stays quick on a
large dataset; a prompt far over the context is counted only up to about the context.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobrunner.driver.rows import RowRequest
from jobrunner.engine.prompt_tokens import text_or_chat_token_ids
from jobrunner.spec import JobSpec

SHOWN_IDS = 3
CHARS_PER_TOKEN_BOUND = 32  # more characters per token than any tokenizer's pieces of real text hold
CUT_MARGIN = 64  # tokens: what cutting a text can add around the cut, and then some


@dataclass
class LengthCheck:
    """What the rows read need from the context (tokens), and the rows that will not fit."""

    rows_read: int = 0
    longest_prompt: int = 0
    longest_id: str = ""
    longest_need: int = 0  # prompt + max_tokens, the most any row read asks for
    too_long: list[str] = field(default_factory=list)  # prompt alone >= context: an error row each
    cut_short: list[str] = field(default_factory=list)  # prompt fits, prompt + max_tokens does not
    not_tokenized: list[tuple[str, str]] = field(default_factory=list)  # (row id, why): an error row each
    context: int = 0


def local_tokenizer_dir(source: str) -> Path | None:
    """A directory holding the model's tokenizer on this machine without downloading or converting anything:
    a local model directory (or file:// URL), or the cached conversion / copy of an alias; else None."""
    from jobrunner.models.sources import ALIASES, cache_root

    if source.startswith("file://"):
        source = source[len("file://"):]
    candidates = [Path(source).expanduser()]
    if source in ALIASES:
        candidates = [cache_root() / "models" / source]
    for path in candidates:
        if path.is_dir() and any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
            return path
    return None


def check_prompt_lengths(spec: JobSpec, requests: list[RowRequest], tokenizer: Any, context: int) -> LengthCheck:
    """Count the prompt tokens of ``requests`` (driver/row_check.py: ``read_requests``, each row's prompt built
    as the worker builds it); rows that are already errors (bad lines, bad per-row settings) are left out: the
    row check names them. Counting stops near the context (:func:`count_prompt_tokens`)."""
    out = LengthCheck(context=context, rows_read=len(requests))
    for req in requests:
        if req.error or req.prompt is None:
            continue
        try:
            num = count_prompt_tokens(tokenizer, req.prompt, context, spec.input.chat_template,
                                      req.chat_template_kwargs)
        except Exception as exc:  # noqa: BLE001 - the tokenizer or its chat template refuses the row: a worker would
            out.not_tokenized.append((req.row_id, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
                                      if str(exc).strip() else type(exc).__name__))
            continue
        max_tokens = getattr(req.params, "max_tokens", 0) or 0
        if num > out.longest_prompt:
            out.longest_prompt, out.longest_id = num, req.row_id
        out.longest_need = max(out.longest_need, num + max_tokens)
        if num >= context:
            out.too_long.append(req.row_id)
        elif num + max_tokens > context:
            out.cut_short.append(req.row_id)
    return out


def count_prompt_tokens(tokenizer: Any, prompt: Any, context: int, chat_template: str | None = None,
                        chat_template_kwargs: dict[str, Any] | None = None) -> int:
    """The prompt's tokens, exact below the context; at or above it, a count >= the context that may stop early.

    A text longer than ``CHARS_PER_TOKEN_BOUND`` characters per context token (and each long message's content)
    is cut to that before tokenizing: if the cut text already has ``context + CUT_MARGIN`` tokens, the whole text
    has at least ``context`` (a cut changes only the tokens around it), so the row is too long and the cut's
    count is returned. Otherwise (a text of unusually long tokens) the whole text is tokenized after all. A
    20 MB prompt against an 8 k context thus costs the tokenizer ~270 k characters instead of 20 M.
    """
    if isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], dict):
        return len(prompt)  # token ids as given
    cut = _cut(prompt, (context + CUT_MARGIN) * CHARS_PER_TOKEN_BOUND)
    if cut is not prompt:
        num = len(text_or_chat_token_ids(tokenizer, cut, chat_template, chat_template_kwargs))
        if num >= context + CUT_MARGIN:
            return num
    return len(text_or_chat_token_ids(tokenizer, prompt, chat_template, chat_template_kwargs))


def _cut(prompt: Any, limit: int) -> Any:
    """``prompt`` with its text (or each message's text content) cut to ``limit`` characters; ``prompt`` itself
    when nothing is longer."""
    if isinstance(prompt, str):
        return prompt[:limit] if len(prompt) > limit else prompt
    long = [isinstance(m.get("content"), str) and len(m["content"]) > limit for m in prompt]
    if not any(long):
        return prompt
    return [{**m, "content": m["content"][:limit]} if is_long else m for m, is_long in zip(prompt, long, strict=True)]


def describe(check: LengthCheck, total_rows: int) -> list[str]:
    """Lines for validate: the longest prompt and need against the context, then a WARNING per kind of row that
    will not fit (first ids named, the setting to change)."""
    read = f"{check.rows_read} of {total_rows} rows read" if check.rows_read < total_rows else \
        f"all {total_rows} rows read"
    if check.longest_prompt >= check.context:  # counted only up to about the context (count_prompt_tokens)
        longest = (f"longest prompt {check.longest_prompt}+ tokens (row {check.longest_id!r}; counted to past "
                   "the context)")
    else:
        longest = (f"longest prompt {check.longest_prompt} tokens (row {check.longest_id!r}), longest prompt + "
                   f"max_tokens {check.longest_need}")
    lines = [f"prompt lengths ({read}): {longest} of the {check.context}-token context"]
    if check.too_long:
        lines.append(f"WARNING: {len(check.too_long)} row(s) have a prompt of the whole context or more and will "
                     f"be error rows ({_ids(check.too_long)}); shorten them or raise engine.max_model_len "
                     f"(up to the model's max_position_embeddings)")
    if check.not_tokenized:
        rid, why = check.not_tokenized[0]
        lines.append(f"WARNING: {len(check.not_tokenized)} row(s) cannot be made into tokens and will be error rows "
                     f"({_ids([i for i, _ in check.not_tokenized])}); row {rid!r}: {why}")
    if check.cut_short:
        lines.append(f"WARNING: {len(check.cut_short)} row(s) cannot get sampling.max_tokens before the context "
                     f"ends ({_ids(check.cut_short)}); their output stops at the context (finish_reason "
                     f"'length'); lower sampling.max_tokens or raise engine.max_model_len")
    return lines


def _ids(ids: list[str]) -> str:
    shown = ", ".join(repr(i) for i in ids[:SHOWN_IDS])
    return f"ids {shown}" + (f" and {len(ids) - SHOWN_IDS} more" if len(ids) > SHOWN_IDS else "")


def tokenizer_for_check(source: str) -> tuple[Any | None, str]:
    """The tokenizer to count with, or None and why not (one line for validate)."""
    path = local_tokenizer_dir(source)
    if path is None:
        return None, (f"prompt lengths not checked: no local copy of {source!r}'s tokenizer "
                      f"(`jobrunner fetch {source}` puts the model in this machine's cache)")
    from jobrunner.models.weights import load_tokenizer

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return load_tokenizer(path), ""
