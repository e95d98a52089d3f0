"""The job manifest and the `_SUCCESS` marker: read (with commit records), atomic write.

From format 3 the manifest is two objects: `_manifest.json` (spec, model, versions, runs, workers, totals)
and the shard table it names, `_shards/<generation>.parquet` (io/shard_file.py). A compaction writes a new
table first, then the JSON naming it (an atomic replace), then deletes older tables: a reader always finds
a complete pair. A reader also folds in the runs' own records (`_runs/`, io/run_records.py), so a run stopped
before its end still counts. Formats 1-2 kept the shards in the JSON (`"shards": {id: entry}`); they are still read.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import numpy as np

from jobrunner.io import shard_file as sf
from jobrunner.io.commits import is_stale, list_commit_records, read_commit_records
from jobrunner.io.layout import LEASE_GENERATION, MANIFEST, SHARDS_DIR, SUCCESS
from jobrunner.io.run_records import fold_run_records, read_run_records
from jobrunner.io.shard_file import COMMITTED, STATUS_VALUES, ShardColumns
from jobrunner.io.storage import Storage

TABLE_READ_ATTEMPTS = 3  # a compaction may delete the table a reader just found named: read the JSON again


class ManifestError(ValueError):
    """A manifest that cannot be parsed; the message names its URL."""


def read_manifest(storage: Storage) -> dict[str, Any] | None:
    """The manifest's JSON object (in format 3 without the shards: see `read_manifest_table`), or None."""
    if not storage.exists(MANIFEST):
        return None
    raw = storage.read_bytes(MANIFEST)
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ManifestError(f"{storage.display(MANIFEST)}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ManifestError(f"{storage.display(MANIFEST)}: expected a JSON object")
    return data


def read_manifest_table(storage: Storage) -> tuple[dict[str, Any], ShardColumns] | None:
    """The manifest (without "shards") and its shard table with every commit record it lacks folded in;
    None when there is no manifest. Builds no Python object per shard for a format 3 manifest."""
    for attempt in range(TABLE_READ_ATTEMPTS):
        manifest = read_manifest(storage)
        if manifest is None:
            return None
        try:
            columns = _shard_columns(storage, manifest)
            break
        except FileNotFoundError:
            if attempt == TABLE_READ_ATTEMPTS - 1:
                raise
    fold_commit_records(storage, columns, manifest.get(LEASE_GENERATION))
    fold_run_records(manifest, read_run_records(storage))  # runs the manifest lacks (stopped before their end)
    return manifest, columns


def _shard_columns(storage: Storage, manifest: dict[str, Any]) -> ShardColumns:
    entries = manifest.pop("shards", None)
    if isinstance(entries, dict):  # format 1-2
        return sf.from_entries({str(k): v for k, v in entries.items() if isinstance(v, dict)})
    table = manifest.get("shard_table")
    if not isinstance(table, dict) or not isinstance(table.get("key"), str):
        raise ManifestError(f"{storage.display(MANIFEST)}: neither 'shards' nor 'shard_table'")
    try:
        return sf.from_parquet(storage.read_bytes(table["key"]))
    except (OSError, ValueError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ManifestError(f"{storage.display(table['key'])}: not a shard table ({exc})") from None


def fold_commit_records(storage: Storage, columns: ShardColumns, generation: int | None = None) -> int:
    """Take the commit records of shards the table does not hold as committed; returns how many. Records
    older than the manifest's lease `generation` (written by a driver that had lost the output) are ignored."""
    todo = []
    for shard_id in list_commit_records(storage):
        index = _row_of(columns, shard_id)
        if index is not None and columns.status[index] != COMMITTED:
            todo.append(shard_id)
    records = {k: r for k, r in read_commit_records(storage, todo).items() if not is_stale(r, generation)}
    for shard_id, record in records.items():
        columns.set_entry(_row_of(columns, shard_id), {k: v for k, v in record.items() if k != "epoch"})
    return len(records)


def _row_of(columns: ShardColumns, shard_id: str) -> int | None:
    index = columns.index_of(shard_id)
    if index is None:  # an id of another form (an old manifest): look it up
        found = np.flatnonzero(columns.shard_id == shard_id.encode())
        index = int(found[0]) if len(found) else None
    return index


def read_manifest_with_records(storage: Storage) -> dict[str, Any] | None:
    """The manifest with its shards as `"shards": {id: entry}` (format 2's form) and every commit record
    folded in; None when there is none. One dict per shard: for small outputs, tools and tests."""
    found = read_manifest_table(storage)
    if found is None:
        return None
    manifest, columns = found
    manifest.pop("shard_table", None)
    manifest["shards"] = sf.to_entries(columns)
    return manifest


def write_manifest(storage: Storage, manifest: dict[str, Any], columns: ShardColumns) -> int:
    """Write the shard table under a new key, then the manifest naming it (atomically), then delete older
    tables; returns the bytes written."""
    table = sf.to_parquet(columns)
    key = f"{SHARDS_DIR}/{uuid.uuid4().hex[:12]}.parquet"
    storage.write_small(key, table)
    counts = np.bincount(columns.status, minlength=len(STATUS_VALUES))
    header = {k: v for k, v in manifest.items() if k != "shards"}
    header["shard_table"] = {"key": key, "num_shards": len(columns),
                             "status_counts": {s: int(counts[i]) for i, s in enumerate(STATUS_VALUES)}}
    data = json.dumps(header, separators=(",", ":"), sort_keys=False).encode()
    storage.write_atomic(MANIFEST, data)
    storage.delete_many([k for k in storage.listdir(SHARDS_DIR) if k != key])
    return len(data) + len(table)


def mark_success(storage: Storage) -> None:
    """Write the `_SUCCESS` marker."""
    storage.write_atomic(SUCCESS, b"")


def clear_success(storage: Storage) -> None:
    """Remove the `_SUCCESS` marker (a job is running again)."""
    storage.delete(SUCCESS)
