"""Compare-and-swap on one small key: the primitive under the output's lease (io/lease.py).

`read_versioned` returns a key's bytes with a version token; `write_if` writes only when the key still has
the version the caller read (or, with version None, only when it does not exist) and returns the new
version, or None when another writer got there first. How each store makes that atomic:

- S3 (s3fs): `PutObject` with `If-None-Match: *` to create, `If-Match: <ETag>` to replace; the server
  decides (412 Precondition Failed: someone else wrote). The version is the ETag.
- Local disk (also NFS): no lock, so no process can block another, even one stopped (SIGSTOP) mid-write.
  Every write adds an immutable version file `<key>.v<N>` (N zero-padded): the writer reads the newest
  version N, compares, writes a temporary file completely (fsync) whose name states its aim
  (`<key>.tmp-<N+1>-<uuid>`, an *intent*), checks that no version N+1 or newer exists yet, then `os.link`s
  it to `<key>.v<N+1>`; the link fails (EEXIST) for all but one writer of each number, and the file appears
  whole or not at all. The current value is the highest N, and the version token is "N:<MD5 of the
  content>", so a writer that resumes after being stopped holds an old N and loses (its compare fails, its
  check sees a newer version, or its link finds N+1 taken). After winning, the writer renames a second link
  of its file onto `<key>` itself (a mirror for readers that open the key directly, so an in-place edit of
  `<key>` edits the newest version and changes its token; each writer re-checks and repairs the mirror, but
  the version files decide) and deletes all but the newest KEEP_VERSIONS version files, never one that a
  present intent aims at: a deleted number could otherwise be linked again by a writer stopped before its
  link, which would then believe it had won. (The collector lists the intents again after choosing what to
  delete, so an intent made while it was choosing is seen; the writer's check comes after its intent exists,
  so a collection that missed it saw a newer version first, and the check sees that too.) A win is final: a
  writer whose link succeeded never takes it back, however many versions land before it returns (the old
  post-link check did, and a slow winner's write then counted as lost though others had built on it).
  A plain `<key>` with no version files (written
  by the earlier flock scheme) reads as version 0 and its first swap creates `<key>.v1`, exclusively as any
  other. Where the filesystem has no hard links, version files are created with O_EXCL instead (a warning
  says a reader may then briefly see one partly written). Deleting the key means deleting `<key>` and
  every `<key>.v*` (the lease code never deletes it).
- memory:// (tests, one process): the same under a process-wide lock.
- Any other store: read, compare, then put; not atomic, so two racing takeovers could both succeed. A
  warning says so once.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time
import uuid
from collections.abc import Callable

import fsspec.asyn

from jobrunner.io.storage import Storage, StorageError
from jobrunner.redaction import redacting_logger

log = redacting_logger(__name__)
_MEMORY_LOCK = threading.Lock()
_WARNED: set[str] = set()


def read_versioned(storage: Storage, rel: str) -> tuple[bytes, str] | None:
    """The key's bytes and version token, or None when it does not exist."""
    if _is_s3(storage):
        return _s3_read(storage, rel)
    if not storage.is_object_store:
        return _local_read_versioned(storage.path(rel))
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
# Version files `<key>.v<N>` beside the key; `<key>` itself is a hard link to the newest one (a mirror for
# readers that open the key directly: `jobrunner status`, reports, an operator's `cat`).
_VERSION_DIGITS = 12
_TMP_MARK = ".tmp-"  # `<key>.tmp-<N>-<uuid>`: a writer's file before it is linked as version N (an intent);
# `<key>.tmp-<uuid>`: a second name of a version on its way onto `<key>` (the mirror)
_LINK_UNSUPPORTED = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS)
KEEP_VERSIONS = 8  # version files kept by garbage collection (the newest and 7 before it)
TMP_MAX_AGE_S = 600.0  # a writer's temporary file older than this is garbage (its writer stopped or died)
READ_TRIES = 1000  # a reader that keeps losing its file to garbage collection gives up (StorageError) after this
_MIRROR_TRIES = 50
_test_hook: Callable[[str], None] | None = None  # tests: called at each step of a local write (see _step)
_WARNED_NO_LINK: set[str] = set()


def _step(name: str) -> None:
    """A point in the local write path where a test may stop the process (SIGSTOP) or inject a delay."""
    if _test_hook is not None:
        _test_hook(name)


def _token(n: int, data: bytes) -> str:
    """The version token: the version's number and its content's MD5 (an in-place edit of `<key>`, which is a
    hard link to the newest version, changes the token too, so the holder of the old one notices)."""
    return f"{n}:{_md5(data)}"


def _version_path(path: str, n: int) -> str:
    return f"{path}.v{n:0{_VERSION_DIGITS}d}"


def _intent_target(tmp: str) -> int | None:
    """The version number an intent file `<key>.tmp-<N>-<uuid>` aims at (None for a mirror's temporary name)."""
    number, dash, _ = tmp.rpartition(_TMP_MARK)[2].partition("-")
    return int(number) if dash and number.isdigit() else None


def _intents(path: str) -> set[int]:
    """The version numbers that writers' intent files beside `path` aim at, from a fresh listing."""
    return {n for n in map(_intent_target, _scan(path)[1]) if n is not None}


def _scan(path: str) -> tuple[list[int], list[str]]:
    """The version numbers present for `path`, and the writers' temporary files beside it."""
    folder, base = os.path.split(path)
    prefix, tmp_prefix = f"{base}.v", f"{base}{_TMP_MARK}"
    versions, tmps = [], []
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return [], []
    for name in names:
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            versions.append(int(name[len(prefix):]))
        elif name.startswith(tmp_prefix):
            tmps.append(os.path.join(folder, name))
    return versions, tmps


def _read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _local_read(path: str) -> tuple[int, bytes] | None:
    """(number, content) of the current version; a plain `<key>` without version files (written before
    version files existed) is version 0; None when neither exists."""
    for _ in range(READ_TRIES):
        versions, _tmps = _scan(path)
        if versions:
            top = max(versions)
            try:
                return top, _read_file(_version_path(path, top))
            except FileNotFoundError:  # collected after a newer version landed (or all deleted): look again
                continue
        try:
            data = _read_file(path)
        except FileNotFoundError:
            data = None
        if _scan(path)[0]:  # the first version appeared meanwhile: read that instead
            continue
        return None if data is None else (0, data)
    raise StorageError(f"{path}: could not read a current version in {READ_TRIES} tries (collected under the reader)")


def _local_read_versioned(path: str) -> tuple[bytes, str] | None:
    current = _local_read(path)
    return None if current is None else (current[1], _token(*current))


def _local_write_if(storage: Storage, rel: str, data: bytes, version: str | None) -> str | None:
    """Compare, then create the next version file exclusively: the `os.link` of a complete temporary file to
    `<key>.v<N+1>` fails for every writer but the first, so one writer wins each number and no lock is held
    that a stopped process could keep."""
    path = storage.path(rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    current = _local_read(path)
    if (current is None) != (version is None) or (current is not None and _token(*current) != version):
        return None
    target = 1 if current is None else current[0] + 1
    _step("compared")
    tmp = f"{path}{_TMP_MARK}{target}-{uuid.uuid4().hex}"  # the intent: from now on `target` is not collected
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        os.write(fd, data)  # small (a lease): one write
        os.fsync(fd)
    finally:
        os.close(fd)
    _step("written")
    if max(_scan(path)[0], default=0) >= target:  # taken already (and perhaps collected before our intent)
        _unlink_quietly(tmp)
        return None
    try:
        won = _publish_version(path, tmp, target, data)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    if not won:
        _unlink_quietly(tmp)
        return None
    _step("linked")
    _mirror(path, tmp, target)
    _collect(path)
    return _token(target, data)


def _publish_version(path: str, tmp: str, target: int, data: bytes) -> bool:
    """Make `tmp` version `target`; False when another writer has had that number.

    Our intent existed before our check found no version `target`, so `target` was never collected under us:
    a successful link is a first one, final whatever lands after it."""
    final = _version_path(path, target)
    try:
        os.link(tmp, final)
    except FileExistsError:
        return False
    except FileNotFoundError:  # our intent was collected as garbage (we were stopped for minutes): too late
        return False
    except OSError as exc:
        if exc.errno not in _LINK_UNSUPPORTED:
            raise
        return _publish_without_links(path, final, target, data)
    _fsync_dir(os.path.dirname(path))
    return True


def _publish_without_links(path: str, final: str, target: int, data: bytes) -> bool:
    """Where the filesystem has no hard links: create the version file exclusively (O_EXCL) and write it.
    Still one winner per number and no lock, but a reader may briefly see the file empty or partly written."""
    folder = os.path.dirname(path)
    if folder not in _WARNED_NO_LINK:
        _WARNED_NO_LINK.add(folder)
        log.warning("%s: this filesystem has no hard links; lease versions are created with O_EXCL instead "
                    "(a reader may briefly see one partly written)", folder)
    try:
        fd = os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        return False
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    _fsync_dir(folder)
    return max(_scan(path)[0], default=0) == target  # strict: any newer version may have read us half-written


def _mirror(path: str, tmp: str, n: int) -> None:
    """Point `<key>` at the newest version. Every writer re-checks after its rename and repairs the mirror
    when a newer version exists, so the last one to rename leaves it current (best effort: a writer stopped
    between its rename and its check leaves it stale until the next write; the version files decide)."""
    source: str | None = tmp  # a second name of version n's file (or, without hard links, a copy of it)
    for _ in range(_MIRROR_TRIES):
        if source is not None:
            try:
                os.replace(source, path)
            except FileNotFoundError:
                pass  # our temporary name was collected (we were stopped for minutes): relink the newest
            # a rename between two names of one file does nothing (POSIX): `<key>` was that version already
            _unlink_quietly(source)
        _step("mirrored")
        top = max(_scan(path)[0], default=0)
        if top <= n:
            return
        source = f"{path}{_TMP_MARK}{uuid.uuid4().hex}"
        try:
            try:
                os.link(_version_path(path, top), source)
            except OSError as exc:
                if exc.errno not in _LINK_UNSUPPORTED:
                    raise
                _copy(_version_path(path, top), source)
        except FileNotFoundError:  # collected meanwhile: a newer one exists, look again
            source = None
            continue
        n = top


def _copy(src: str, dst: str) -> None:
    data = _read_file(src)
    with open(dst, "wb") as f:
        f.write(data)


def _collect(path: str) -> None:
    """Delete temporary files older than TMP_MAX_AGE_S, then version files older than the newest
    KEEP_VERSIONS that no present intent aims at.

    Old temporary files go first: an intent stops protecting its number only once its file is gone, so its
    writer, if it ever resumes, finds nothing to link. The intents are listed again after the versions: a
    writer whose intent that listing misses made it before this one began, after the versions were listed,
    hence after the version that dooms its number existed, and its own check then refuses it."""
    versions, tmps = _scan(path)
    now = time.time()
    for tmp in tmps:
        try:
            if now - os.stat(tmp).st_mtime > TMP_MAX_AGE_S:
                _unlink_quietly(tmp)
        except FileNotFoundError:
            pass
    if not versions:
        return
    top = max(versions)
    doomed = [n for n in versions if n <= top - KEEP_VERSIONS]
    if not doomed:
        return
    aimed_at = _intents(path)
    for n in sorted(doomed):
        if n not in aimed_at:
            _unlink_quietly(_version_path(path, n))


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory
    finally:
        os.close(fd)


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
