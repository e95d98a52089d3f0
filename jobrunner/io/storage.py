"""fsspec access with retries: filesystems from URLs, atomic writes (temp key, then commit), listing.

Object stores have no atomic rename; ``commit`` is a move there (copy + delete), which is atomic enough for
us because readers only look at final keys and a key is either absent or complete.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import re
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec
from fsspec.core import url_to_fs

from jobrunner.io.layout import TEMP_DIR
from jobrunner.io.repeats import FoldedWarnings
from jobrunner.redaction import redact_text, redacting_logger

log = redacting_logger(__name__)
# A full disk or an outage fails every operation: one line per cause a minute, then a count (io/repeats.py).
RETRY_WARNINGS = FoldedWarnings(log, "storage retries")
atexit.register(RETRY_WARNINGS.flush)
TEMP_PROBE = f"{TEMP_DIR}/probe"
T = TypeVar("T")

# Errors that mean "this will not get better by retrying".
_PERMANENT = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, ValueError)


class StorageError(RuntimeError):
    """A storage operation that failed after retries; the message names the URL (credentials cut out)."""

    def __init__(self, message: str) -> None:
        super().__init__(redact_text(str(message)))


def retry(what: str, fn: Callable[[], T], attempts: int = 4, backoff_s: float = 0.2) -> T:
    """Run fn, retrying transient errors with exponential backoff; StorageError names `what`. Missing or
    refused credentials fail at once (retrying cannot help) with what to set (credential_help)."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - storage backends raise anything
            if is_credential_error(exc):
                raise StorageError(f"{what}: {_describe(exc)}\n{credential_help(what)}") from exc
            if isinstance(exc, _PERMANENT):
                raise _named(exc, what) from exc
            if attempt == attempts:
                raise StorageError(f"{what}: failed after {attempts} attempts: {_describe(exc)}") from exc
            RETRY_WARNINGS.warn(_kind(exc), f"{what}: attempt {attempt} failed ({_describe(exc)}); retrying")
            time.sleep(backoff_s * 2 ** (attempt - 1))
    raise AssertionError("unreachable")


# Exception class names (anywhere in the cause chain) and message fragments that mean missing or refused
# credentials: botocore / aiobotocore (S3), google.auth (GCS), azure.identity, and the S3 error codes.
_CREDENTIAL_CLASSES = ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                       "DefaultCredentialsError", "RefreshError", "ClientAuthenticationError",
                       "CredentialUnavailableError")
_CREDENTIAL_CODES = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                     "Unable to locate credentials")


def is_credential_error(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) says the credentials are missing, incomplete or refused."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if type(current).__name__ in _CREDENTIAL_CLASSES or any(c in str(current) for c in _CREDENTIAL_CODES):
            return True
        current = current.__cause__ or current.__context__
    return False


def credential_help(what: str) -> str:
    """Which settings or environment variables would give credentials for the store `what` names (worded so
    that the message's redaction leaves it readable: no `name: value` pairs)."""
    where = "the spec's storage_options (input.storage_options / output.storage_options) as ${env:NAME} references"
    if "gs://" in what or "gcs://" in what:
        return ("  GCS needs credentials. Set GOOGLE_APPLICATION_CREDENTIALS (a service-account JSON file) where "
                f"the job runs, or the option token in {where}; the token 'anon' reads a public bucket")
    if "az://" in what or "abfs://" in what or "abfss://" in what:
        return ("  Azure needs credentials. Set AZURE_STORAGE_CONNECTION_STRING (or AZURE_STORAGE_ACCOUNT_NAME "
                f"and AZURE_STORAGE_ACCOUNT_KEY) where the job runs, or account_name and account_key in {where}")
    return ("  S3 needs credentials. Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE with "
            "~/.aws/credentials) where the driver and workers run, or the options key and secret in "
            f"{where}; for MinIO, R2 and other S3-compatible stores also endpoint_url; anon=true reads a "
            "public bucket")


def _named(exc: Exception, what: str) -> Exception:
    """The same kind of error with `what` (the operation and URL) in front of its message."""
    try:
        return type(exc)(redact_text(f"{what}: {exc}"))
    except Exception:  # noqa: BLE001 - exotic constructor: keep the original
        return exc


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _kind(exc: BaseException) -> str:
    """What retries of one cause share, whatever the key: `OSError [Errno 28] No space left on device`."""
    errno = getattr(exc, "errno", None)
    if isinstance(exc, OSError) and errno is not None:
        return f"{type(exc).__name__} [Errno {errno}] {exc.strerror or ''}".strip()
    return type(exc).__name__


class Storage:
    """One filesystem plus a root path; all paths are relative to the root."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/") or url  # "/" stays the root
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
        self.put_retried(tmp, data)
        self.commit(tmp, rel)

    def put(self, rel: str, data: bytes) -> None:
        """Write a key directly (not atomic: callers write temporary keys with it)."""
        if not _is_object_store(self.fs):
            self.fs.makedirs(self.path(rel).rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(self.path(rel), data)

    def put_retried(self, rel: str, data: bytes) -> None:
        """`put` with retries; after a failed attempt (its reply lost, say) a key already holding exactly
        `data` (size, and MD5 ETag on object stores) counts as written instead of being uploaded again."""
        failed = [False]

        def attempt() -> None:
            if failed[0] and _matches(self._info(rel), len(data), hashlib.md5(data).hexdigest()):
                log.info("write %s: an earlier attempt had written it (its reply was lost)", self.display(rel))
                return
            failed[0] = True  # until put returns: a failure below may still have written the key
            self.put(rel, data)
            failed[0] = False

        retry(f"write {self.display(rel)}", attempt)

    def commit(self, tmp: str, rel: str) -> int:
        """Move a finished temporary key to its final key; returns its size in bytes.

        Idempotent: a move whose reply was lost (the key moved, the retry then finds no source) is checked
        at the destination; the source's size and identity (ETag on object stores, inode on disk) there
        means it moved, and the retry succeeds instead of failing with FileNotFoundError."""
        source = retry(f"inspect {self.display(tmp)}", lambda: self._info(tmp))
        if source is None:
            raise _named(FileNotFoundError(self.display(tmp)), f"commit {self.display(rel)}: no temporary key")
        tried = [False]

        def move() -> None:
            if tried[0] and self._moved(tmp, rel, source):
                return
            tried[0] = True
            if not _is_object_store(self.fs):
                self.fs.makedirs(self.path(rel).rsplit("/", 1)[0], exist_ok=True)
            try:
                self.fs.mv(self.path(tmp), self.path(rel))
            except FileNotFoundError:
                if not self._moved(tmp, rel, source):
                    raise

        retry(f"commit {self.display(rel)}", move)
        return int(source.get("size") or 0)

    def _info(self, rel: str) -> dict[str, Any] | None:
        """A key's listing info (size, ETag / inode), None when it does not exist."""
        self.fs.invalidate_cache(self.path(rel))
        try:
            return self.fs.info(self.path(rel))
        except FileNotFoundError:
            return None

    def _moved(self, tmp: str, rel: str, source: dict[str, Any]) -> bool:
        """Whether an earlier move of `tmp` (described by `source`) has landed at `rel`."""
        if self._info(tmp) is not None:
            return False
        landed = _matches(self._info(rel), source.get("size"), _etag(source), source.get("ino"))
        if landed:
            log.info("commit %s: an earlier attempt had moved it (its reply was lost)", self.display(rel))
        return landed

    def list_sizes(self, rel: str) -> dict[str, int]:
        """Keys under a prefix (relative to root) -> size in bytes, from one listing; empty when none."""
        self.fs.invalidate_cache()
        try:
            entries = retry(f"list {self.display(rel)}", lambda: self.fs.ls(self.path(rel), detail=True))
        except FileNotFoundError:
            return {}
        prefix = self.root + "/"
        return {e["name"][len(prefix):] if e["name"].startswith(prefix) else e["name"]: int(e.get("size") or 0)
                for e in entries if e.get("type") != "directory"}

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

    # ---- small objects for the driver's bookkeeping (commit records, lease) ----------------------------
    @property
    def is_object_store(self) -> bool:
        """True on object stores (no rename; a put is atomic), False on local disk."""
        return _is_object_store(self.fs)

    def write_small(self, rel: str, data: bytes) -> None:
        """Write a small key so readers see either nothing or all of it: one put on an object store (atomic
        there), temporary file + rename on local disk."""
        if self.is_object_store:
            retry(f"write {self.display(rel)}", lambda: self.put(rel, data))
        else:
            self.write_atomic(rel, data)

    def is_root(self) -> bool:
        """True for a bucket root or a filesystem root (never a place to delete everything under)."""
        if _protocol(self.fs) in ("file", "memory"):
            return self.root.strip("/") == ""
        return "/" not in self.root.strip("/")  # "bucket" alone

    def contains_url(self, url: str, storage_options: dict[str, Any] | None = None) -> bool:
        """Whether `url` (a file, folder or glob) is this root or lies under it, on the same filesystem
        (local paths compared resolved: symlinks followed)."""
        return is_within(resolved_location(url, storage_options), self.location())

    def location(self) -> tuple[str, str]:
        """(protocol, path) of the root; on local disk the real path (symlinks followed)."""
        return _resolved(self.fs, self.root)

    def listdir_kinds(self, rel: str = "") -> dict[str, bool]:
        """Names (relative to root) under a prefix -> whether each is a folder; empty when it does not exist."""
        self.fs.invalidate_cache()
        try:
            entries = retry(f"list {self.display(rel)}", lambda: self.fs.ls(self.path(rel), detail=True))
        except FileNotFoundError:
            return {}
        prefix = self.root + "/"
        return {(e["name"][len(prefix):] if e["name"].startswith(prefix) else e["name"]).rstrip("/"):
                e.get("type") == "directory" for e in entries}

    def read_many(self, rels: list[str]) -> dict[str, bytes]:
        """Read many small keys (concurrently on object stores); missing keys are left out."""
        if not rels:
            return {}
        paths = {self.path(r): r for r in rels}
        got = retry(f"read {len(rels)} keys under {self.display()}",
                    lambda: self.fs.cat(list(paths), on_error="return"))
        return {paths[p]: v for p, v in got.items() if isinstance(v, bytes)}

    def delete_many(self, rels: list[str]) -> None:
        """Delete many keys (batched on object stores); missing keys are fine."""
        if rels:
            try:
                retry(f"delete {len(rels)} keys under {self.display()}",
                      lambda: self.fs.rm([self.path(r) for r in rels]))
            except FileNotFoundError:
                for rel in rels:
                    self.delete(rel)


def resolved_location(url: str, storage_options: dict[str, Any] | None = None) -> tuple[str, str] | None:
    """(protocol, path) of a URL, a glob cut back to the folder before its first wildcard; on local disk the
    real path (symlinks followed, so two spellings of one folder compare equal: `file:///d/in/`, `/d/in`,
    `d/in` from /). None if it cannot be parsed."""
    found = _split_glob(url, storage_options)
    return None if found is None else (found[0], found[1])


def resolved_pattern(url: str, storage_options: dict[str, Any] | None = None) -> tuple[str, str] | None:
    """(protocol, pattern) of a glob URL, its folder before the first wildcard resolved as in
    `resolved_location`; None for a URL without a wildcard (or one that cannot be parsed)."""
    found = _split_glob(url, storage_options)
    return None if found is None or not found[2] else (found[0], f"{found[1]}/{found[2]}")


def _split_glob(url: str, storage_options: dict[str, Any] | None) -> tuple[str, str, str] | None:
    """(protocol, resolved folder, the pattern's rest from the first wildcard's path part on, or '')."""
    try:
        fs, path = url_to_fs(url, **(storage_options or {}))
    except (ValueError, ImportError, TypeError):
        return None
    rest = ""
    for i, ch in enumerate(path):
        if ch in "*?[":
            folder = path[:i].rsplit("/", 1)[0]
            path, rest = folder, path[len(folder) + 1:]
            break
    protocol, folder = _resolved(fs, path)
    return protocol, folder, rest


def glob_matches(pattern: str, path: str) -> bool:
    """Whether `path` matches a glob as fsspec reads it: `**` any depth, `*` and `?` within one name."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 1:]:
            end = pattern.index("]", i + 1)
            out.append("[" + pattern[i + 1:end].replace("!", "^", 1) + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.fullmatch("".join(out), path.rstrip("/")) is not None


def is_within(inner: tuple[str, str] | None, outer: tuple[str, str] | None) -> bool:
    """Whether location `inner` is `outer` or lies under it (same protocol)."""
    if inner is None or outer is None or inner[0] != outer[0]:
        return False
    path, root = inner[1].rstrip("/"), outer[1].rstrip("/")
    return path == root or path.startswith(root + "/") or root == ""


def _resolved(fs: fsspec.AbstractFileSystem, path: str) -> tuple[str, str]:
    protocol = _protocol(fs)
    if protocol == "file":
        return protocol, os.path.realpath(path)
    return protocol, path.rstrip("/")


def _etag(info: dict[str, Any]) -> str | None:
    """An object's ETag when it is the MD5 of its bytes (not a multipart ETag `<md5>-<parts>`)."""
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"')
    return etag.lower() if etag and "-" not in etag else None


def _matches(info: dict[str, Any] | None, size: Any, md5: str | None = None, ino: Any = None) -> bool:
    """Whether a key's info shows the expected bytes: its size, and where both sides know them its MD5
    ETag and its inode."""
    if info is None or size is None or int(info.get("size") or 0) != int(size):
        return False
    etag = _etag(info)
    if md5 is not None and etag is not None and etag != md5:
        return False
    return ino is None or info.get("ino") is None or info.get("ino") == ino


def _protocol(fs: fsspec.AbstractFileSystem) -> str:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return "file" if protocol == "local" else protocol


def _is_object_store(fs: fsspec.AbstractFileSystem) -> bool:
    return _protocol(fs) != "file"
