"""Copy a model directory from any fsspec URL (s3://, gs://, memory://, ...) into a local cache.

The cache entry is named after the URL *and* a fingerprint of the remote listing (name, size, etag or
mtime of every fetched file), so a changed model downloads again while an unchanged one is reused. Each entry
is built in a temporary directory and renamed into place under a file lock (`build_dir_once`), so concurrent
workers never read a partial copy. Only top-level files matching the patterns are fetched.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from pathlib import Path, PurePosixPath
from typing import Any

import fsspec

from jobrunner.io.local_cache import build_dir_once

# Listing fields that change when an object changes, most specific first (S3, GCS, local, memory).
_VERSION_FIELDS = ("ETag", "etag", "md5Hash", "crc32c", "LastModified", "last_modified", "mtime", "created")


def fetch_model_dir(
    url: str,
    storage_options: dict | None,
    cache_root: str | Path,
    *,
    patterns: list[str],
    required: str = "config.json",
) -> Path:
    """Return a local copy of the model directory at `url`, downloading it only when it changed.

    `patterns` (fnmatch, on file names): which top-level files make the model (`models.sources.fetch_patterns`).
    `required`: the file the directory must hold (a LoRA adapter's: `adapter_config.json`). Raises
    FileNotFoundError if `url` lists no files, ValueError if it has no `required` file.
    """
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    name_to_info = list_model_files(fs, root, patterns)
    if not name_to_info:
        raise FileNotFoundError(f"model URL {url!r}: no model files found there")
    if required not in name_to_info:
        raise ValueError(f"model URL {url!r}: no {required} in {sorted(name_to_info)}")
    target = Path(cache_root).expanduser() / cache_key(url, storage_options, name_to_info)
    return build_dir_once(target, lambda tmp: download_files(fs, name_to_info, tmp))


def check_model_url(url: str, storage_options: dict | None, patterns: list[str]) -> int:
    """How many model files `url` lists (nothing downloaded); FileNotFoundError / ValueError as fetch_model_dir."""
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    name_to_info = list_model_files(fs, root, patterns)
    if not name_to_info:
        raise FileNotFoundError(f"model URL {url!r}: no model files found there")
    if "config.json" not in name_to_info:
        raise ValueError(f"model URL {url!r}: no config.json in {sorted(name_to_info)}")
    return len(name_to_info)


def read_config_text(url: str, storage_options: dict | None = None) -> str:
    """The text of the model's ``config.json`` at storage URL ``url`` (that one small object, nothing else)."""
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    path = f"{root.rstrip('/')}/config.json"
    try:
        return fs.cat_file(path).decode("utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"model URL {url!r}: no config.json there") from None


def list_model_files(fs: fsspec.AbstractFileSystem, root: str, patterns: list[str]) -> dict[str, dict]:
    """Map file name -> listing info for the top-level files under `root` that match `patterns`."""
    fs.invalidate_cache(root)  # a cached listing would hide changes made since
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return {}
    name_to_info = {}
    for entry in entries:
        name = PurePosixPath(entry["name"].rstrip("/")).name
        if entry.get("type") == "file" and any(fnmatch.fnmatch(name, p) for p in patterns):
            name_to_info[name] = entry
    return name_to_info


def cache_key(url: str, storage_options: dict | None, name_to_info: dict[str, dict]) -> str:
    """`<hash of where>-<hash of what>`: same URL and unchanged files give the same key."""
    endpoint = _endpoint(storage_options or {})
    where = hashlib.sha256(f"{url.rstrip('/')}|{endpoint}".encode()).hexdigest()[:16]
    listing = sorted((name, info.get("size"), _version(info)) for name, info in name_to_info.items())
    what = hashlib.sha256(json.dumps(listing, default=str).encode()).hexdigest()[:16]
    return f"{where}-{what}"


def download_files(fs: fsspec.AbstractFileSystem, name_to_info: dict[str, dict], out_dir: Path) -> None:
    """Copy each listed file into `out_dir`, checking that the sizes match the listing."""
    for name, info in sorted(name_to_info.items()):
        local = out_dir / name
        fs.get_file(info["name"], str(local))
        expected = info.get("size")
        if expected is not None and local.stat().st_size != expected:
            raise OSError(f"{info['name']}: copied {local.stat().st_size} bytes, listing says {expected}")


def _version(info: dict[str, Any]) -> str | None:
    for field in _VERSION_FIELDS:
        if info.get(field) is not None:
            return str(info[field])
    return None


def _endpoint(storage_options: dict) -> str:
    """The endpoint part of storage options (never credentials), so two S3 servers do not share a key."""
    client_kwargs = storage_options.get("client_kwargs") or {}
    return str(storage_options.get("endpoint_url") or client_kwargs.get("endpoint_url") or "")
