"""Read benchmark prompts from a local .jsonl or .parquet file (a ``prompt`` or ``messages`` column)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PromptRow = str | list[dict[str, Any]]
COLUMNS = ("prompt", "messages")


class PromptFileError(ValueError):
    """The prompt file is missing, unreadable or lacks a usable column; the message names the file."""


def read_prompts(path: str | Path, limit: int | None = None) -> list[PromptRow]:
    """The first ``limit`` prompts of ``path``: strings (``prompt``) or chat message lists (``messages``).

    A row with both columns uses ``messages``. Raises :class:`PromptFileError` naming the file and problem.
    """
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"prompt file {str(path)!r} not found")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = _read_jsonl(path, limit)
    elif suffix in (".parquet", ".parq"):
        rows = [(f"row {i}", row) for i, row in enumerate(_read_parquet(path, limit))]
    else:
        raise PromptFileError(f"prompt file {str(path)!r}: expected a .jsonl or .parquet file")
    prompts = [_prompt_of(row, path, where) for where, row in rows]
    if not prompts:
        raise PromptFileError(f"prompt file {str(path)!r} has no rows")
    return prompts


def _read_jsonl(path: Path, limit: int | None) -> list[tuple[str, dict[str, Any]]]:
    """(\"line N\", object) of the first `limit` non-blank lines; bad bytes or JSON name their line."""
    rows: list[tuple[str, dict[str, Any]]] = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if limit is not None and len(rows) >= limit:
                break
            if not raw.strip():
                continue
            where = f"prompt file {str(path)!r} line {lineno}"
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise PromptFileError(f"{where}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
            except ValueError as exc:
                raise PromptFileError(f"{where}: not JSON: {exc}") from None
            if not isinstance(row, dict):
                raise PromptFileError(f"{where}: expected a JSON object")
            rows.append((f"line {lineno}", row))
    return rows


def _read_parquet(path: Path, limit: int | None) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(str(path))
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a broken file
        raise PromptFileError(f"prompt file {str(path)!r}: not a readable Parquet file: {exc}") from None
    columns = [c for c in COLUMNS if c in pf.schema_arrow.names]
    if not columns:
        raise PromptFileError(f"prompt file {str(path)!r} has no 'prompt' or 'messages' column "
                              f"(columns: {', '.join(pf.schema_arrow.names)})")
    rows: list[dict[str, Any]] = []
    for batch in pf.iter_batches(batch_size=1024, columns=columns):
        rows += batch.to_pylist()
        if limit is not None and len(rows) >= limit:
            return rows[:limit]
    return rows


def _prompt_of(row: dict[str, Any], path: Path, at: str) -> PromptRow:
    messages, prompt = row.get("messages"), row.get("prompt")
    where = f"prompt file {str(path)!r} {at}"
    if messages is not None:
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise PromptFileError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        return [dict(m) for m in messages]
    if prompt is not None:
        if not isinstance(prompt, str):
            raise PromptFileError(f"{where}: 'prompt' must be a string, got {type(prompt).__name__}")
        return prompt
    raise PromptFileError(f"{where} has no 'prompt' or 'messages' value (keys: {', '.join(sorted(row))})")
