"""The job manifest (`_manifest.json`) and the `_SUCCESS` marker: read (with commit records), atomic write."""

from __future__ import annotations

import json
from typing import Any

from jobrunner.io.commits import fold_records, list_commit_records, read_commit_records
from jobrunner.io.layout import MANIFEST, SUCCESS
from jobrunner.io.storage import Storage


class ManifestError(ValueError):
    """A manifest that cannot be parsed; the message names its URL."""


def read_manifest(storage: Storage) -> dict[str, Any] | None:
    """The manifest, or None when there is none."""
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


def read_manifest_with_records(storage: Storage) -> dict[str, Any] | None:
    """The manifest with every commit record not yet compacted into it folded in (None: no manifest)."""
    manifest = read_manifest(storage)
    if manifest is None:
        return None
    shards = manifest.get("shards") or {}
    todo = [s for s in list_commit_records(storage) if (shards.get(s) or {}).get("status") != "committed"]
    fold_records(manifest, read_commit_records(storage, todo))
    return manifest


def write_manifest(storage: Storage, manifest: dict[str, Any]) -> int:
    """Write the manifest atomically (temporary key, then commit over the old one); returns its bytes."""
    data = json.dumps(manifest, separators=(",", ":"), sort_keys=False).encode()
    storage.write_atomic(MANIFEST, data)
    return len(data)


def mark_success(storage: Storage) -> None:
    """Write the `_SUCCESS` marker."""
    storage.write_atomic(SUCCESS, b"")


def clear_success(storage: Storage) -> None:
    """Remove the `_SUCCESS` marker (a job is running again)."""
    storage.delete(SUCCESS)
