"""OpenAI-style result files of an `openai_batch` job, under `_openai/` so Parquet readers skip them.

Each shard writes its lines to `_openai/parts/output-<shard_id>.jsonl` and `errors-<shard_id>.jsonl` (atomic,
before its Parquet part is committed; a retried shard overwrites them). When every shard is committed the
driver concatenates them, in shard order, into `_openai/output.jsonl` and `_openai/errors.jsonl`.
"""

from __future__ import annotations

import json
from typing import Any

from jobrunner.io.storage import Storage

OPENAI_DIR = "_openai"
OPENAI_PARTS_DIR = f"{OPENAI_DIR}/parts"
OUTPUT_FILE = f"{OPENAI_DIR}/output.jsonl"
ERRORS_FILE = f"{OPENAI_DIR}/errors.jsonl"


def write_openai_part(storage: Storage, shard_id: str, outputs: list[dict[str, Any]],
                      errors: list[dict[str, Any]]) -> None:
    """Write one shard's output and error lines (each file even when empty, so a merge sees every shard)."""
    storage.write_atomic(f"{OPENAI_PARTS_DIR}/output-{shard_id}.jsonl", _jsonl(outputs))
    storage.write_atomic(f"{OPENAI_PARTS_DIR}/errors-{shard_id}.jsonl", _jsonl(errors))


def merge_openai_parts(storage: Storage, shard_ids: list[str]) -> list[str]:
    """Concatenate the shards' parts into the two result files; returns their keys."""
    for kind, key in (("output", OUTPUT_FILE), ("errors", ERRORS_FILE)):
        data = b"".join(storage.read_bytes(f"{OPENAI_PARTS_DIR}/{kind}-{s}.jsonl") for s in shard_ids)
        storage.write_atomic(key, data)
    return [OUTPUT_FILE, ERRORS_FILE]


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line, ensure_ascii=False).encode("utf-8") + b"\n" for line in lines)
