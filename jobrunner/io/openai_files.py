"""OpenAI-style result files of an `openai_batch` job, under `_openai/` so Parquet readers skip them.

Written by the driver once every shard is committed, from the committed Parquet parts (the one source of
truth: a late or duplicate shard attempt can never make these files disagree with the parts).
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from jobrunner.io.layout import OPENAI_DIR
from jobrunner.io.parts import read_part
from jobrunner.io.storage import Storage

OUTPUT_FILE = f"{OPENAI_DIR}/output.jsonl"
ERRORS_FILE = f"{OPENAI_DIR}/errors.jsonl"
# What a result line is built from (never kept input columns).
RESULT_COLUMNS = ("id", "sample_index", "generated_text", "finish_reason", "error", "num_prompt_tokens",
                  "num_output_tokens", "ttft_s", "logprobs")
OPTIONAL_RESULT_COLUMNS = ("reasoning", "num_reasoning_tokens", "tool_calls",  # reasoning parser, tools
                           "embedding")  # a task embed job's /v1/embeddings lines


def read_result_rows(storage: Storage, part_keys: list[str]) -> list[dict[str, Any]]:
    """The result columns of the committed parts, as plain rows. Parts of a resumed job written by an older
    jobrunner (logprobs without `token_bytes`) read with that field null."""
    tables = []
    for key in part_keys:
        table = read_part(storage, key)
        optional = [c for c in OPTIONAL_RESULT_COLUMNS if c in table.column_names]
        tables.append(table.select(list(RESULT_COLUMNS) + optional))
    return pa.concat_tables(tables, promote_options="permissive").to_pylist() if tables else []


def write_openai_results(storage: Storage, outputs: list[dict[str, Any]], errors: list[dict[str, Any]]) -> list[str]:
    """Write the output and error lines (each file even when empty); returns their keys."""
    storage.write_atomic(OUTPUT_FILE, _jsonl(outputs))
    storage.write_atomic(ERRORS_FILE, _jsonl(errors))
    return [OUTPUT_FILE, ERRORS_FILE]


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line, ensure_ascii=False).encode("utf-8") + b"\n" for line in lines)
