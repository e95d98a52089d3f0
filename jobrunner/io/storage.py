"""fsspec access with retries: filesystems from URLs, atomic writes (temp key, then commit), listing.

Object stores have no atomic rename; ``commit`` is a move there (copy + delete), which is atomic enough for
us because readers only look at final keys and a key is either absent or complete.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec
from fsspec.core import url_to_fs

from jobrunner.io.layout import TEMP_DIR
from jobrunner.redaction import redact_text

log = logging.getLogger(__name__)
TEMP_PROBE = f"{TEMP_DIR}/probe"
T = TypeVar("T")

# Errors that mean "this will not get better by retrying".
_PERMANENT = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, ValueError)


class StorageError(RuntimeError):
    """A storage operation that failed after retries; the message names the URL (credentials cut out)."""

    def __init__(self, message: str) -> None:
        super().__init__(redact_text(str(message)))


def retry(what: str, fn: Callable[[], T], attempts: int = 4, backoff_s: float = 0.2) -> T:
    """Run fn, retrying transient errors with exponential backoff; StorageError names `what`."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except _PERMANENT as exc:
            raise _named(exc, what) from exc
        except Exception as exc:  # noqa: BLE001 - storage backends raise anything
            if attempt == attempts:
                raise StorageError(f"{what}: failed after {attempts} attempts: {_describe(exc)}") from exc
            log.warning("%s: attempt %d failed (%s); retrying", what, attempt, _describe(exc))
            time.sleep(backoff_s * 2 ** (attempt - 1))
    raise AssertionError("unreachable")


def _named(exc: Exception, what: str) -> Exception:
    """The same kind of error with `what` (the operation and URL) in front of its message."""
    try:
        return type(exc)(redact_text(f"{what}: {exc}"))
    except Exception:  # noqa: BLE001 - exotic constructor: keep the original
        return exc


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Storage:
    """One filesystem plus a root path; all paths are relative to the root."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.fs, root = url_to_fs(self.url, **(storage_options or {}))
        self.root = root.rstrip("/")

    def path(self, rel: str) -> str:
        """Absolute filesystem path of a relative key."""
        return f"{self.root}/{rel}" if rel else self.root

    def display(self, rel: str = "") -> str:
        """A URL for messages."""
        return f"{self.url}/{rel}" if rel else self.url

    def exists(self, rel: str) -> bool:
        """Whether a key exists."""
        self.fs.invalidate_cache()
        return retry(f"check {self.display(rel)}", lambda: self.fs.exists(self.path(rel)))

    def read_bytes(self, rel: str) -> bytes:
        """Read a whole key."""
        return retry(f"read {self.display(rel)}", lambda: self.fs.cat_file(self.path(rel)))

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Write to a temporary key, then commit to `rel` (overwriting any previous value)."""
        # `.tmp`: a glob reader (`OUT/**/*.parquet`) never picks up a write in flight or one left by a crash.
        tmp = f"{TEMP_DIR}/{uuid.uuid4().hex}-{rel.replace('/', '_')}.tmp"
        retry(f"write {self.display(tmp)}", lambda: self.put(tmp, data))
        self.commit(tmp, rel)

    def put(self, rel: str, data: bytes) -> None:
        """Write a key directly (not atomic: callers write temporary keys with it)."""
        if not _is_object_store(self.fs):
            self.fs.makedirs(self.path(rel).rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(self.path(rel), data)

    def commit(self, tmp: str, rel: str) -> None:
        """Move a finished temporary key to its final key."""

        def move() -> None:
            if not _is_object_store(self.fs):
                self.fs.makedirs(self.path(rel).rsplit("/", 1)[0], exist_ok=True)
            self.fs.mv(self.path(tmp), self.path(rel))

        retry(f"commit {self.display(rel)}", move)

    def delete(self, rel: str, recursive: bool = False) -> None:
        """Delete a key (or a prefix); missing is fine."""
        try:
            retry(f"delete {self.display(rel)}", lambda: self.fs.rm(self.path(rel), recursive=recursive))
        except FileNotFoundError:
            pass

    def listdir(self, rel: str = "") -> list[str]:
        """Names (relative to root) under a prefix; empty when it does not exist."""
        self.fs.invalidate_cache()
        try:
            entries = retry(f"list {self.display(rel)}", lambda: self.fs.ls(self.path(rel), detail=False))
        except FileNotFoundError:
            return []
        prefix = self.root + "/"
        return sorted(e[len(prefix):] if e.startswith(prefix) else e for e in entries)

    def check_writable(self) -> None:
        """Write and delete a probe key, so a missing bucket or a permission problem shows before any work."""
        probe = f"{TEMP_PROBE}-{uuid.uuid4().hex}"
        retry(f"write {self.display(probe)}", lambda: self.put(probe, b""))
        self.delete(probe)

    def is_empty(self) -> bool:
        """True when nothing exists under the root."""
        return not self.listdir("")


def _is_object_store(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol not in ("file", "local")
