"""Output parts: the output row schema, writing one shard's rows as a committed Parquet part, reading back."""

from __future__ import annotations

import io
import struct
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from jobrunner.io.decode import positions_of
from jobrunner.io.layout import PARTS_DIR, attempt_part_key, part_key
from jobrunner.io.output_dupes import OUTPUT_FINGERPRINT, output_fingerprints
from jobrunner.io.reader import ROW_INDEX, map_files
from jobrunner.io.storage import Storage, StorageError, retry
from jobrunner.redaction import redact_text

# One token's log-probability and its top alternatives (the `logprobs` / `prompt_logprobs` list elements).
# token_bytes: the token's raw bytes (a piece of a multi-byte character has `token` U+FFFD but its own bytes).
TOP_LOGPROB_TYPE = pa.struct([("token_id", pa.int64()), ("token", pa.string()), ("logprob", pa.float64()),
                              ("token_bytes", pa.binary())])
LOGPROB_TYPE = pa.struct([("token_id", pa.int64()), ("token", pa.string()), ("logprob", pa.float64()),
                          ("top_logprobs", pa.list_(TOP_LOGPROB_TYPE)), ("token_bytes", pa.binary())])

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
    ("sample_index", pa.int64()),
    ("prompt_shared", pa.bool_()),
    ("logprobs", pa.list_(LOGPROB_TYPE)),
    ("prompt_logprobs", pa.list_(LOGPROB_TYPE)),
    # a 64-bit hash of what the row's request was made of (io/fingerprints.py): an incremental run compares it
    ("request_fingerprint", pa.int64()),
])
# Only with output.format = messages: the input chat plus the generated assistant turn.
MESSAGES_FIELD = pa.field("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))
# Only in jobs whose rows can carry a JSON schema: whether the text is schema-valid JSON (null: no schema, error).
JSON_VALID_FIELD = pa.field("json_valid", pa.bool_())
# Only with a reasoning parser (output.reasoning_parser): the trace apart from the answer (generated_text).
REASONING_FIELDS = (pa.field("reasoning", pa.string()), pa.field("num_reasoning_tokens", pa.int64()))
# Only in jobs whose rows can carry tools: the model's calls in OpenAI's form, and why a reply did not parse.
TOOL_CALL_TYPE = pa.struct([("id", pa.string()), ("type", pa.string()),
                            ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())]))])
TOOL_FIELDS = (pa.field("tool_calls", pa.list_(TOOL_CALL_TYPE)), pa.field("tool_call_warning", pa.string()))
# Only in jobs with input.adapter_column: the LoRA adapter the row ran with (null: the base model).
ADAPTER_FIELD = pa.field("adapter", pa.string())
# Only with output.dedupe = prompts: the id of the earlier row whose request this row repeats (finish_reason
# 'duplicate', not generated); null for every generated row.
DEDUPE_FIELD = pa.field("dedupe_of", pa.string())
# Only with output.dedupe = outputs: a 64-bit hash of generated_text (null without text), io/output_dupes.py.
OUTPUT_FINGERPRINT_FIELD = pa.field(OUTPUT_FINGERPRINT, pa.int64())
_DEDUPE_FIELDS = {"prompts": (DEDUPE_FIELD,), "outputs": (OUTPUT_FINGERPRINT_FIELD,)}
# Only in engine.backend openai jobs: the sends a row's request needed beyond the first (429, 5xx, drops).
RETRIES_FIELD = pa.field("num_retries", pa.int64())
# Only in jobs whose rows can carry images (an image column, a messages column, OpenAI batch lines): the row's
# images, and the prompt tokens that stand for them (part of num_prompt_tokens; null: the engine does not say).
IMAGE_FIELDS = (pa.field("num_images", pa.int64()), pa.field("num_image_tokens", pa.int64()))

# Only in embed / score jobs (prefill-only rows, generated_text null): their result, by output task.
TASK_FIELDS = {
    "generate": (),
    "embed": (pa.field("embedding", pa.list_(pa.float32())),),
    "classify": (pa.field("scores", pa.list_(pa.float32())),),   # one per label, the head's raw outputs
    "loglik": (pa.field("completion_logprob", pa.float64()),      # sum over the completion's tokens
               pa.field("completion_logprobs", pa.list_(pa.float32())),
               pa.field("num_completion_tokens", pa.int64())),
}


def output_schema(output_format: str = "parquet", json_valid: bool = False, reasoning: bool = False,
                  tools: bool = False, task: str = "generate", adapter: bool = False,
                  dedupe: str = "none", retries: bool = False, images: bool = False) -> pa.Schema:
    """The output row schema of a job with this output.format (plus ``json_valid`` when rows can have a
    schema, ``reasoning`` / ``num_reasoning_tokens`` with a reasoning parser, ``tool_calls`` /
    ``tool_call_warning`` when rows can carry tools, the result columns of an embed / score ``task``:
    ``embed``, ``classify`` or ``loglik``, ``adapter`` when rows name a LoRA adapter, ``dedupe_of`` with
    output.dedupe prompts, ``output_fingerprint`` with output.dedupe outputs, ``num_retries`` for an endpoint,
    ``num_images`` / ``num_image_tokens`` where rows can carry images)."""
    schema = OUTPUT_SCHEMA.append(MESSAGES_FIELD) if output_format == "messages" else OUTPUT_SCHEMA
    schema = schema.append(JSON_VALID_FIELD) if json_valid else schema
    extra = (REASONING_FIELDS if reasoning else ()) + (TOOL_FIELDS if tools else ()) + TASK_FIELDS[task]
    extra += ((ADAPTER_FIELD,) if adapter else ()) + _DEDUPE_FIELDS.get(dedupe, ())
    extra += (RETRIES_FIELD,) if retries else ()
    extra += IMAGE_FIELDS if images else ()
    for field in extra:
        schema = schema.append(field)
    return schema


def rows_to_table(rows: list[dict[str, Any]], kept: pa.Table | None = None,
                  schema: pa.Schema = OUTPUT_SCHEMA) -> pa.Table:
    """Output rows (dicts with the contract columns and ROW_INDEX) as a table, plus kept input columns.

    kept: the shard's input table with the kept columns and ROW_INDEX; its rows are matched by ROW_INDEX
    (several output rows may take the same input row: the samples of one row). A kept column named like an
    output column is an error (the planner reports it first, naming the column).
    """
    columns = {f.name: pa.array([_cell(r, f.name) for r in rows], f.type) for f in schema}
    table = pa.table(columns, schema=schema)
    if OUTPUT_FINGERPRINT in schema.names:  # output.dedupe outputs: each text's hash, from the column
        index = schema.get_field_index(OUTPUT_FINGERPRINT)
        table = table.set_column(index, schema.field(index), output_fingerprints(table.column("generated_text")))
    if kept is None or kept.num_columns <= 1:
        return table
    indices = pa.array(positions_of(kept, [r[ROW_INDEX] for r in rows]), pa.int64())
    for name in kept.column_names:
        if name in schema.names:
            raise ValueError(f"output.keep_columns: input column {name!r} has the name of an output column")
        if name != ROW_INDEX:
            table = table.append_column(kept.schema.field(name), kept.column(name).take(indices))
    return table


# ---- issue 11: one schema for every part; no secret in an error text --------------------------------------
def part_schema(kept: pa.Schema | None = None, base: pa.Schema = OUTPUT_SCHEMA) -> pa.Schema:
    """The exact schema of every part of a job (what `rows_to_table` gives): the contract columns with their
    Arrow types (a part whose rows are all errors, every `generated_text` null, included), then the kept input
    columns with their input types (planning checks that each has one type across the input files)."""
    fields = list(base)
    if kept is not None:
        fields += [f for f in kept if f.name != ROW_INDEX and f.name not in base.names]
    return pa.schema(fields)


def _cell(row: dict[str, Any], name: str) -> Any:
    """A row's value for a contract column; an error text loses any credential it quotes (URLs, tokens)."""
    value = row.get(name)
    return redact_text(value) if name == "error" and isinstance(value, str) else value


def write_part(storage: Storage, shard_id: str, table: pa.Table) -> str:
    """Write a shard's table and commit it as the shard's part at once; returns the part key.

    For single-writer uses (tests, tools). The driver instead has workers write attempts
    (`write_attempt_part`) and commits the one it assigned (`commit_part`)."""
    return commit_part(storage, write_attempt_part(storage, "direct", shard_id, 0, table), part_key(shard_id))


def write_attempt_part(storage: Storage, attempt_id: str, shard_id: str, row_start: int, table: pa.Table) -> str:
    """Write one attempt's rows to an attempt-scoped temporary key (never a visible part); returns the key.

    A zombie attempt (its worker declared dead, the shard retried elsewhere) can only ever write here."""
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    key = attempt_part_key(attempt_id, shard_id, row_start)
    storage.put_retried(key, buf.getvalue())
    return key


def commit_part(storage: Storage, temp_key: str, final_key: str) -> str:
    """Publish an attempt's temporary part at its final key (rename on disk, server-side copy on object
    stores); only the driver calls this, for the attempt it assigned. Returns the final key. A move whose
    reply was lost is resolved at the destination (`Storage.commit`)."""
    storage.commit(temp_key, final_key)
    return final_key


def commit_parts(storage: Storage, temp_keys: list[str], final_keys: list[str]) -> list[int]:
    """`commit_part` for each of a shard's parts; returns their sizes in bytes (kept in its commit record,
    so a resume can check each part before trusting it)."""
    return [storage.commit(t, f) for t, f in zip(temp_keys, final_keys, strict=True)]


FOOTER_GUESS = 64 * 1024  # one ranged read of a part's tail holds its footer (a part has few row groups)


def part_row_counts(storage: Storage, sizes: dict[str, int]) -> dict[str, int | None]:
    """Part key -> its row count from its Parquet footer (None when the part is not readable Parquet).
    sizes: key -> size in bytes (from a listing). Footers are read concurrently, one ranged read each."""
    keys = list(sizes)
    return dict(zip(keys, map_files(lambda k: _footer_rows(storage, k, sizes[k]), keys), strict=True))


def _footer_rows(storage: Storage, key: str, size: int) -> int | None:
    try:
        tail = retry(f"read {storage.display(key)}",
                     lambda: storage.fs.cat_file(storage.path(key), start=max(0, size - FOOTER_GUESS), end=size))
        length = struct.unpack("<i", tail[-8:-4])[0] if len(tail) >= 12 and tail[-4:] == b"PAR1" else -1
        if not 0 < length <= size - 12:
            return None
        if length + 8 > len(tail):
            tail = retry(f"read {storage.display(key)}",
                         lambda: storage.fs.cat_file(storage.path(key), start=size - length - 8, end=size))
        return pq.read_metadata(pa.BufferReader(b"PAR1" + tail[-length - 8:])).num_rows
    except (OSError, pa.ArrowInvalid, StorageError):
        return None


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
