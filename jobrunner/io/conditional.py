"""Compare-and-swap on one small key: the primitive under the output's lease (io/lease.py).

`read_versioned` returns a key's bytes with a version token; `write_if` writes only when the key still has
the version the caller read (or, with version None, only when it does not exist) and returns the new
version, or None when another writer got there first. How each store makes that atomic:

- S3 (s3fs): `PutObject` with `If-None-Match: *` to create, `If-Match: <ETag>` to replace; the server
  decides (412 Precondition Failed: someone else wrote). The version is the ETag.
- Local disk: the compare and the rename happen under an exclusive `flock` on a lock file beside the key
  (`<key>.lock`); the kernel drops the lock if its process dies. The version is the content's MD5, and
  every lease body differs (run id, generation, beat), so equal MD5 means the same write.
- memory:// (tests, one process): the same under a process-wide lock.
- Any other store: read, compare, then put; not atomic, so two racing takeovers could both succeed. A
  warning says so once.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import threading
import time
import uuid

import fsspec.asyn

from jobrunner.io.storage import Storage, StorageError
from jobrunner.redaction import redacting_logger

log = redacting_logger(__name__)
_MEMORY_LOCK = threading.Lock()
_WARNED: set[str] = set()
LOCK_TIMEOUT_S = 5.0  # a local writer holds the lock for microseconds; longer means a stopped process


def read_versioned(storage: Storage, rel: str) -> tuple[bytes, str] | None:
    """The key's bytes and version token, or None when it does not exist."""
    if _is_s3(storage):
        return _s3_read(storage, rel)
    try:
        data = storage.fs.cat_file(storage.path(rel))
    except FileNotFoundError:
        return None
    return data, _md5(data)


def write_if(storage: Storage, rel: str, data: bytes, version: str | None) -> str | None:
    """Write `data` at `rel` only if the key still has `version` (None: only if it does not exist).

    Returns the new version, or None when the condition failed. Transient errors raise (callers retry)."""
    if _is_s3(storage):
        return _s3_write_if(storage, rel, data, version)
    if not storage.is_object_store:
        return _local_write_if(storage, rel, data, version)
    if "memory" in (storage.fs.protocol if isinstance(storage.fs.protocol, tuple) else (storage.fs.protocol,)):
        with _MEMORY_LOCK:
            return _compare_then_put(storage, rel, data, version)
    _warn_once(storage)
    return _compare_then_put(storage, rel, data, version)


def _md5(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def _compare_then_put(storage: Storage, rel: str, data: bytes, version: str | None) -> str | None:
    current = read_versioned(storage, rel)
    if (current is None) != (version is None) or (current is not None and current[1] != version):
        return None
    storage.put(rel, data)
    return _md5(data)


def _warn_once(storage: Storage) -> None:
    protocol = str(storage.fs.protocol)
    if protocol not in _WARNED:
        _WARNED.add(protocol)
        log.warning("%s: no conditional writes on this store; the output lease is best effort there", protocol)


# ---- local disk --------------------------------------------------------------------------------------
def _local_write_if(storage: Storage, rel: str, data: bytes, version: str | None) -> str | None:
    path = storage.path(rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _lock(fd, path)
        try:
            current = read_versioned(storage, rel)
            if (current is None) != (version is None) or (current is not None and current[1] != version):
                return None
            tmp = f"{path}.{uuid.uuid4().hex}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            return _md5(data)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _lock(fd: int, path: str) -> None:
    """An exclusive flock, polled so that a stopped holder shows up as a (transient) error, not a hang."""
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise StorageError(f"{path}.lock: held by another process for over {LOCK_TIMEOUT_S:.0f} s") from None
            time.sleep(0.005)


# ---- S3 ----------------------------------------------------------------------------------------------
def _is_s3(storage: Storage) -> bool:
    return hasattr(storage.fs, "_call_s3")


def _split(storage: Storage, rel: str) -> tuple[str, str]:
    bucket, key, _ = storage.fs.split_path(storage.path(rel))
    return bucket, key


def _s3_read(storage: Storage, rel: str) -> tuple[bytes, str] | None:
    fs = storage.fs
    bucket, key = _split(storage, rel)

    async def get() -> tuple[bytes, str]:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key)
        body = await resp["Body"].read()
        return body, resp["ETag"]

    try:
        return fsspec.asyn.sync(fs.loop, get)
    except FileNotFoundError:
        return None


def _s3_write_if(storage: Storage, rel: str, data: bytes, version: str | None) -> str | None:
    bucket, key = _split(storage, rel)
    condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
    try:
        resp = storage.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
    except FileExistsError:  # s3fs's name for a 412 on If-None-Match
        return None
    except FileNotFoundError:  # If-Match on a key that was deleted meanwhile
        return None
    except OSError as exc:
        if _is_precondition_failure(exc):
            return None
        raise
    storage.fs.invalidate_cache(storage.path(rel))
    return resp["ETag"]


def _is_precondition_failure(exc: BaseException) -> bool:
    """A 412 in the shapes s3fs/botocore give it (a 409 ConditionalRequestConflict is transient: retry)."""
    text = f"{exc} {exc.__cause__ or ''}"
    return "PreconditionFailed" in text or "pre-conditions you specified did not hold" in text or " 412" in text
