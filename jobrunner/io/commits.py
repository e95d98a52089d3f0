"""Commit records: one small JSON object per committed shard under `_commits/`.

Committing a shard writes only its own record (O(1) bytes per shard, whatever the job's size); the full
`_manifest.json` (with its shard table) is a compaction of the records, written every so often and at the end.
Readers (resume, reports) take the manifest and fold in the records it does not yet hold (io/manifest.py).
"""

from __future__ import annotations

import json
from typing import Any

from jobrunner.io.layout import COMMITS_DIR, commit_record_key
from jobrunner.io.storage import Storage


def write_commit_record(storage: Storage, shard_id: str, entry: dict[str, Any], epoch: int | None = None) -> int:
    """Write one shard's commit record (its manifest entry, plus the writer's lease generation `epoch`);
    returns the bytes written."""
    fenced = {"shard_id": shard_id, **entry} if epoch is None else {"shard_id": shard_id, "epoch": epoch, **entry}
    data = json.dumps(fenced, separators=(",", ":")).encode()
    storage.write_small(commit_record_key(shard_id), data)
    return len(data)


def list_commit_records(storage: Storage) -> list[str]:
    """Shard ids that have a commit record."""
    names = (key.rsplit("/", 1)[-1] for key in storage.listdir(COMMITS_DIR))
    return [n[: -len(".json")] for n in names if n.endswith(".json")]


def read_commit_records(storage: Storage, shard_ids: list[str]) -> dict[str, dict[str, Any]]:
    """shard_id -> record for the given shards (concurrent reads; unreadable records are skipped)."""
    raw = storage.read_many([commit_record_key(s) for s in shard_ids])
    out: dict[str, dict[str, Any]] = {}
    for key, data in raw.items():
        try:
            record = json.loads(data)
        except ValueError:  # a torn record cannot exist (atomic writes); skip rather than fail a resume
            continue
        if isinstance(record, dict) and record.get("status") == "committed":
            out[key.rsplit("/", 1)[-1][: -len(".json")]] = record
    return out


def delete_commit_records(storage: Storage, shard_ids: list[str]) -> None:
    """Remove records already folded into a written manifest."""
    storage.delete_many([commit_record_key(s) for s in shard_ids])


def is_stale(record: dict[str, Any], generation: int | None) -> bool:
    """A record written under an older lease generation than the manifest's: a driver that had lost the
    output wrote it after the current run's start-up compaction (which folds and deletes every earlier
    record), so it is ignored."""
    epoch = record.get("epoch")
    return isinstance(epoch, int) and isinstance(generation, int) and epoch < generation
