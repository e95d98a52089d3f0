"""The job manifest (`_manifest.json`) and the `_SUCCESS` marker: read, atomic write."""

from __future__ import annotations

import json
from typing import Any

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


def write_manifest(storage: Storage, manifest: dict[str, Any]) -> None:
    """Write the manifest atomically (temporary key, then commit over the old one)."""
    storage.write_atomic(MANIFEST, json.dumps(manifest, indent=1, sort_keys=False).encode())


def mark_success(storage: Storage) -> None:
    """Write the `_SUCCESS` marker."""
    storage.write_atomic(SUCCESS, b"")


def clear_success(storage: Storage) -> None:
    """Remove the `_SUCCESS` marker (a job is running again)."""
    storage.delete(SUCCESS)
