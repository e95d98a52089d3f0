"""Output parts: the output row schema, writing one shard's rows as a committed Parquet part, reading back."""

from __future__ import annotations

import io
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from jobrunner.io.layout import PARTS_DIR, part_key
from jobrunner.io.reader import ROW_INDEX
from jobrunner.io.storage import Storage
from jobrunner.redaction import redact_text

# The contract columns, in order (docs/contracts.md).
OUTPUT_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("generated_text", pa.string()),
    ("finish_reason", pa.string()),
    ("error", pa.string()),
    ("num_prompt_tokens", pa.int64()),
    ("num_cached_tokens", pa.int64()),
    ("num_output_tokens", pa.int64()),
    ("ttft_s", pa.float64()),
    ("itl_mean_s", pa.float64()),
    ("e2e_s", pa.float64()),
    ("queue_s", pa.float64()),
    ("shard_id", pa.string()),
    ("worker_id", pa.string()),
    ("finish_time_s", pa.float64()),
])


def output_schema(kept: pa.Schema | None = None) -> pa.Schema:
    """The schema of every part: the contract columns with their exact types, then the kept input columns
    with their input types (planning checks that every input file gives a kept column one type). A part whose
    rows are all errors (every `generated_text` null) has this schema too."""
    fields = list(OUTPUT_SCHEMA)
    if kept is not None:
        fields += [f for f in kept if f.name != ROW_INDEX and f.name not in OUTPUT_SCHEMA.names]
    return pa.schema(fields)


def rows_to_table(rows: list[dict[str, Any]], kept: pa.Table | None = None) -> pa.Table:
    """Output rows (dicts with the contract columns and ROW_INDEX) as a table of `output_schema`, plus kept
    input columns.

    kept: the shard's input table with the kept columns and ROW_INDEX; its rows are matched by ROW_INDEX.
    """
    schema = output_schema(kept.schema if kept is not None else None)
    arrays = [pa.array([_cell(r, f.name) for r in rows], f.type) for f in OUTPUT_SCHEMA]
    if len(schema) > len(OUTPUT_SCHEMA):
        first = kept.column(ROW_INDEX)[0].as_py() if kept.num_rows else 0
        indices = pa.array([r[ROW_INDEX] - first for r in rows], pa.int64())
        arrays += [kept.column(f.name).take(indices) for f in list(schema)[len(OUTPUT_SCHEMA):]]
    return pa.Table.from_arrays(arrays, schema=schema)


def _cell(row: dict[str, Any], name: str) -> Any:
    """A row's value for a contract column; error texts lose any credentials they quote (URLs, tokens)."""
    value = row.get(name)
    return redact_text(value) if name == "error" and isinstance(value, str) else value


def write_part(storage: Storage, shard_id: str, table: pa.Table) -> str:
    """Write a shard's table to a temporary key and commit it as the shard's part; returns the part key.

    A retried shard commits to the same key, so it replaces rather than duplicates.
    """
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    key = part_key(shard_id)
    storage.write_atomic(key, buf.getvalue())
    return key


def list_parts(storage: Storage) -> list[str]:
    """Committed part keys."""
    return [k for k in storage.listdir(PARTS_DIR) if k.rsplit("/", 1)[-1].startswith("part-")]


def read_part(storage: Storage, key: str) -> pa.Table:
    """One part as a table."""
    return pq.read_table(io.BytesIO(storage.read_bytes(key)))


def read_output(url: str, storage_options: dict[str, Any] | None = None) -> pa.Table:
    """All committed parts of an output as one table (empty with the contract schema when none)."""
    storage = Storage(url, storage_options)
    tables = [read_part(storage, k) for k in list_parts(storage)]
    return pa.concat_tables(tables, promote_options="default") if tables else OUTPUT_SCHEMA.empty_table()
