"""`jobrunner validate`'s prompt-length check: the input's rows made into prompts as a worker makes them,
tokenized with the model's own tokenizer, against the context a worker will have (prompt + max_tokens).

Only a tokenizer already on this machine is used (a local model directory, or an alias or source that
`jobrunner fetch` put in the cache): validate never downloads weights. At most ``max_rows`` rows are read
(the first rows of each file in turn), so the check stays quick on a large dataset.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobrunner.driver.plan import JobPlan
from jobrunner.driver.rows import is_generating, job_sampling, read_shard_input, to_request
from jobrunner.engine.prompt_tokens import text_or_chat_token_ids
from jobrunner.spec import JobSpec

MAX_ROWS = 5_000
SHOWN_IDS = 3


@dataclass
class LengthCheck:
    """What the rows read need from the context (tokens), and the rows that will not fit."""

    rows_read: int = 0
    longest_prompt: int = 0
    longest_id: str = ""
    longest_need: int = 0  # prompt + max_tokens, the most any row read asks for
    too_long: list[str] = field(default_factory=list)  # prompt alone >= context: an error row each
    cut_short: list[str] = field(default_factory=list)  # prompt fits, prompt + max_tokens does not
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


def check_prompt_lengths(spec: JobSpec, plan: JobPlan, tokenizer: Any, context: int,
                         max_rows: int = MAX_ROWS) -> LengthCheck:
    """Read up to ``max_rows`` rows of ``plan``'s files, build each row's prompt as the worker does
    (driver/rows.py: to_request) and count its tokens; rows that are already errors (bad lines, bad per-row
    settings) are left to the run, which writes them as error rows."""
    sampling = job_sampling(spec) if is_generating(spec) else None
    out = LengthCheck(context=context)
    for file in plan.files:
        take = min(file.num_rows, max_rows - out.rows_read)
        if take <= 0:
            break
        table, _ = read_shard_input(spec, file.url, 0, take)
        for row in table.to_pylist():
            out.rows_read += 1
            req = to_request(spec, file.stem, row, sampling if sampling is not None else _pooling(spec))
            if req.error or req.prompt is None:
                continue
            prompt = req.prompt
            if isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], dict):
                num = len(prompt)  # token ids as given
            else:
                num = len(text_or_chat_token_ids(tokenizer, prompt, spec.input.chat_template,
                                                 req.chat_template_kwargs))
            max_tokens = getattr(req.params, "max_tokens", 0) or 0
            if num > out.longest_prompt:
                out.longest_prompt, out.longest_id = num, req.row_id
            out.longest_need = max(out.longest_need, num + max_tokens)
            if num >= context:
                out.too_long.append(req.row_id)
            elif num + max_tokens > context:
                out.cut_short.append(req.row_id)
    return out


def _pooling(spec: JobSpec) -> Any:
    from jobrunner.driver.pooled import job_pooling

    return job_pooling(spec)


def describe(check: LengthCheck, total_rows: int) -> list[str]:
    """Lines for validate: the longest prompt and need against the context, then a WARNING per kind of row that
    will not fit (first ids named, the setting to change)."""
    read = f"{check.rows_read} of {total_rows} rows read" if check.rows_read < total_rows else \
        f"all {total_rows} rows read"
    lines = [f"prompt lengths ({read}): longest prompt {check.longest_prompt} tokens (row {check.longest_id!r}), "
             f"longest prompt + max_tokens {check.longest_need} of the {check.context}-token context"]
    if check.too_long:
        lines.append(f"WARNING: {len(check.too_long)} row(s) have a prompt of the whole context or more and will "
                     f"be error rows ({_ids(check.too_long)}); shorten them or raise engine.max_model_len "
                     f"(up to the model's max_position_embeddings)")
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
