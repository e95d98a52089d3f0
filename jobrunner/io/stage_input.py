"""A pipeline stage's input files and the pipeline's final parts, written from the previous stage's parts.

`<output>/stages/<name>/_input/<shard id>.parquet` holds, for one committed shard of the previous stage, the
rows that go on (pipeline/handoff.py: not error rows, passed the filter), with `id`, the carried columns, the
built request columns and ROW_ERROR (a template that could not be filled: the row's error). The file is a
pure function of the upstream part and the spec, written once (temporary object, then an atomic publish) and
never rewritten: a rerun after a crash finds it and reuses it. The final output's parts (`<output>/parts/`)
are the same for the last stage, keeping every column. Each file records its shard's funnel (rows by outcome)
in its Parquet metadata, so a report sums footers instead of re-reading rows.
"""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jobrunner.io.commits import is_stale, list_commit_records, read_commit_records
from jobrunner.io.layout import LEASE_GENERATION, PARTS_DIR, STAGE_INPUT_DIR
from jobrunner.io.manifest import read_manifest, read_manifest_table
from jobrunner.io.parts import read_part
from jobrunner.io.reader import ROW_ERROR
from jobrunner.io.shard_file import COMMITTED
from jobrunner.io.storage import Storage
from jobrunner.pipeline.handoff import (
    COMPLETION_COLUMN,
    CONVERSATION,
    MESSAGES_COLUMN,
    METRIC_COLUMNS,
    PROMPT_COLUMN,
    Funnel,
    Handoff,
)

INPUT_DIR = STAGE_INPUT_DIR  # under a stage's output: its input files
PIPELINE_FILE = "_pipeline.json"  # a pipeline's record: its stages, its funnel (driver/pipeline.py)
STAGES_DIR = "stages"  # a pipeline's stage outputs: stages/<name>/
FUNNEL_KEY = b"jobrunner.funnel"  # Parquet key-value metadata: the upstream shard's rows by outcome


def input_key(shard_id: str) -> str:
    """Key of a stage's input file for upstream shard `shard_id` (under the stage's output)."""
    return f"{INPUT_DIR}/{shard_id}.parquet"


def final_key(shard_id: str) -> str:
    """Key of the pipeline's final part for last-stage shard `shard_id` (under the pipeline's output)."""
    return f"{PARTS_DIR}/part-{shard_id}.parquet"


def committed_shards(storage: Storage) -> dict[str, list[str]]:
    """Shard id -> part keys of every committed shard of an output (its manifest's table with its commit records
    folded in); {} when it has no manifest yet."""
    found = read_manifest_table(storage)
    if found is None:
        return {}
    _, columns = found
    return {columns.id_of(i): columns.parts_of(i) for i in np.flatnonzero(columns.status == COMMITTED).tolist()}


class CommittedLister:
    """The committed shards of an output that is still being written (a pipeline's previous stage), polled
    cheaply: its shard table is read again only when the manifest names a new one (a compaction), and only the
    commit records of shards not seen yet are read (one small read each, on an object store a GET). `known`: ids
    the caller has taken already (they are never returned again)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.table_key: str | None = None
        self.in_table: dict[str, list[str]] = {}  # committed shards of the last table read: id -> part keys

    def new_shards(self, known: set[str]) -> dict[str, list[str]]:
        """Shard id -> part keys of the committed shards not in `known`."""
        manifest = read_manifest(self.storage)
        if manifest is None:
            return {}
        key = (manifest.get("shard_table") or {}).get("key")
        if key is None or key != self.table_key:  # a new table (or a format without one): read it whole
            self.in_table = committed_shards(self.storage)
            self.table_key = key
        found = {i: p for i, p in self.in_table.items() if i not in known}
        todo = [i for i in list_commit_records(self.storage) if i not in known and i not in found]
        generation = manifest.get(LEASE_GENERATION)
        for shard_id, record in read_commit_records(self.storage, todo).items():
            if not is_stale(record, generation):
                found[shard_id] = [str(p) for p in record.get("parts") or [record.get("part")] if p]
        return found


def input_rows(storage: Storage, key: str) -> int | None:
    """Rows of an existing file (its footer), None when there is none."""
    if not storage.exists(key):
        return None
    return pq.ParquetFile(io.BytesIO(storage.read_bytes(key))).metadata.num_rows


def read_funnel(storage: Storage, key: str) -> dict[str, Any] | None:
    """The funnel recorded in a file's footer (None when the file or the record is absent)."""
    if not storage.exists(key):
        return None
    meta = pq.ParquetFile(io.BytesIO(storage.read_bytes(key))).schema_arrow.metadata or {}
    raw = meta.get(FUNNEL_KEY)
    return json.loads(raw) if raw else None


def hand_on(upstream: Storage, parts: list[str], target: Storage, key: str, handoff: Handoff) -> int:
    """Write the file `key` under `target` from the upstream shard's `parts` (next stage's input when
    handoff.next is set, else a final part) unless it exists; its row count either way."""
    existing = input_rows(target, key)
    if existing is not None:
        return existing
    table = pa.concat_tables([read_part(upstream, p) for p in parts], promote_options="default")
    out, funnel = handed_on_table(table, handoff)
    meta = {**(out.schema.metadata or {}), FUNNEL_KEY: json.dumps(funnel.to_dict()).encode()}
    buffer = io.BytesIO()
    pq.write_table(out.replace_schema_metadata(meta), buffer)
    target.write_atomic(key, buffer.getvalue())
    return out.num_rows


def handed_on_table(table: pa.Table, handoff: Handoff) -> tuple[pa.Table, Funnel]:
    """The rows of `table` that go on, as the next stage's input (or final) table, and the shard's funnel."""
    funnel, kept, computed = Funnel(), [], []
    for index, row in enumerate(table.to_pylist()):
        row = handoff.enrich(row)
        outcome, message = handoff.decide(row)
        funnel.add(outcome, message)
        if outcome == "kept":
            kept.append(index)
            computed.append(row)
    taken = table.take(pa.array(kept, pa.int64()))
    extra = {name: _typed([r.get(name) for r in computed]) for name in _added_names(handoff, table)}
    if handoff.next is None:
        return _with_columns(taken, extra), funnel
    return _next_input(taken, extra, [handoff.next_row(r) for r in computed], handoff), funnel


def _added_names(handoff: Handoff, table: pa.Table) -> list[str]:
    names = list(handoff.output_columns)
    if names and ("json_valid" not in table.column_names):
        names.append("json_valid")
    return names


def _with_columns(table: pa.Table, extra: dict[str, pa.Array]) -> pa.Table:
    for name, values in extra.items():
        if name in table.column_names:
            table = table.set_column(table.column_names.index(name), name, values)
        else:
            table = table.append_column(name, values)
    return table


def _next_input(taken: pa.Table, extra: dict[str, pa.Array], rows: list[dict[str, Any]], handoff: Handoff) -> pa.Table:
    """Carried columns (renamed where they clash with the next stage's output), then id and the request."""
    built = (PROMPT_COLUMN, MESSAGES_COLUMN, COMPLETION_COLUMN, CONVERSATION)
    carried = [c for c in taken.column_names if c not in METRIC_COLUMNS and c not in extra and c != "id"
               and c not in built]
    out = pa.table({"id": taken.column("id").cast(pa.string())})
    for name in carried:
        out = out.append_column(handoff.carried_name(name), taken.column(name))
    for name, values in extra.items():
        out = out.append_column(handoff.carried_name(name), values)
    for name in built:
        out = out.append_column(name, pa.array([r.get(name) for r in rows], pa.string()))
    return out.append_column(ROW_ERROR, pa.array([r.get("error") for r in rows], pa.string()))


def _typed(values: list[Any]) -> pa.Array:
    """An output column: float64 when every value is a number (or null), bool when every one is a bool,
    else text (so one column keeps one type from part to part as far as the values allow)."""
    present = [v for v in values if v is not None]
    if all(isinstance(v, bool) for v in present) and present:
        return pa.array(values, pa.bool_())
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        return pa.array([None if v is None else float(v) for v in values], pa.float64())
    return pa.array([None if v is None else v if isinstance(v, str) else json.dumps(v) for v in values], pa.string())


def funnel_of(storage: Storage, keys: list[str]) -> dict[str, Any]:
    """The funnels recorded in these files' footers, summed (rows in / kept / dropped / filter errors / error
    rows), with the first filter errors."""
    total: dict[str, Any] = {"rows_in": 0, "kept": 0, "dropped": 0, "filter_error": 0, "error": 0,
                             "filter_error_examples": [], "shards": 0}
    for data in storage.read_many(keys).values():
        meta = pq.ParquetFile(io.BytesIO(data)).schema_arrow.metadata or {}
        funnel = json.loads(meta.get(FUNNEL_KEY) or b"{}")
        total["shards"] += 1
        for name in ("rows_in", "kept", "dropped", "filter_error", "error"):
            total[name] += int(funnel.get(name) or 0)
        examples = total["filter_error_examples"]
        examples.extend((funnel.get("filter_error_examples") or [])[:max(0, 5 - len(examples))])
    return total


def list_handed_on(storage: Storage, folder: str) -> list[str]:
    """The files a stage's rows were handed on to: `_input/*.parquet` of the next stage, or the final `parts/`."""
    return sorted(k for k in storage.listdir(folder) if k.endswith(".parquet"))


def pipeline_funnel(root: Storage, names: list[str]) -> list[dict[str, Any]]:
    """Per stage: rows in, kept, dropped by its filter, filter errors, error rows (from the footers of the files
    its rows were handed on to: the next stage's `_input/`, or the final `parts/`)."""
    out = []
    for i, name in enumerate(names):
        folder = f"{STAGES_DIR}/{names[i + 1]}/{INPUT_DIR}" if i + 1 < len(names) else PARTS_DIR
        out.append({"stage": name, **funnel_of(root, list_handed_on(root, folder))})
    return out


def read_pipeline(root: Storage) -> dict[str, Any] | None:
    """`_pipeline.json` of a pipeline's output (None when the output is not a pipeline's)."""
    return json.loads(root.read_bytes(PIPELINE_FILE)) if root.exists(PIPELINE_FILE) else None
