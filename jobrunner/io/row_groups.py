"""Reading Parquet footers and row groups so that each byte of the input is fetched once.

- A footer is read exactly (its 8-byte trailer, then the footer itself) and kept per process, so a worker
  reads a file's footer once however many of its shards it runs.
- Data is read a whole row group at a time, column chunk by column chunk (no pre-buffering, no read-ahead
  cache): the bytes fetched are exactly the column chunks of the columns asked for.
- A row group that planning split into several shards (it had more rows than rows_per_shard) is decoded once
  and kept (a small LRU) for that process's next pieces of it, so it is fetched once per worker, not once per
  shard. Shards of smaller row groups follow row-group boundaries and are never cached.

`ReadStats` counts what was fetched, for the read-amplification figure (bytes read / input bytes).
"""

from __future__ import annotations

import io
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

FOOTER_TRAILER = 8  # little-endian footer length + b"PAR1"


@dataclass
class ReadStats:
    """Bytes and requests fetched from input files (footers and column chunks counted apart)."""

    footer_bytes: int = 0
    data_bytes: int = 0
    num_reads: int = 0

    @property
    def total_bytes(self) -> int:
        return self.footer_bytes + self.data_bytes


class CountingFile:
    """A read-only file wrapper that adds what pyarrow reads through it to `stats.data_bytes`."""

    def __init__(self, f: Any, stats: ReadStats | None) -> None:
        self._f, self._stats, self.closed = f, stats, False

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        if self._stats is not None:
            self._stats.data_bytes += len(data)
            self._stats.num_reads += 1
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True


def read_footer(f: Any, size: int, stats: ReadStats | None = None) -> pq.FileMetaData:
    """The footer of an open Parquet file of `size` bytes, read with two exact range reads."""
    return parse_footer(read_footer_bytes(f, size, stats))


def parse_footer(raw: bytes) -> pq.FileMetaData:
    """Footer bytes (as `read_footer_bytes` gives them) as Parquet metadata."""
    return pq.read_metadata(pa.BufferReader(b"PAR1" + raw))


def read_footer_bytes(f: Any, size: int, stats: ReadStats | None = None) -> bytes:
    """The footer of an open Parquet file of `size` bytes and its 8-byte trailer, read with two exact range
    reads (the bytes also fingerprint the file: row group sizes, offsets and statistics)."""
    if size < 12:
        raise pa.ArrowInvalid(f"file of {size} bytes is too small to be Parquet")
    f.seek(size - FOOTER_TRAILER)
    trailer = f.read(FOOTER_TRAILER)
    length, magic = struct.unpack("<i", trailer[:4])[0], trailer[4:]
    if magic != b"PAR1" or not 0 < length <= size - 12:
        raise pa.ArrowInvalid("not a Parquet file (bad footer magic or length)")
    f.seek(size - FOOTER_TRAILER - length)
    footer = f.read(length)
    if stats is not None:
        stats.footer_bytes += length + FOOTER_TRAILER
        stats.num_reads += 2
    return footer + trailer


def groups_for(meta: pq.FileMetaData, row_start: int, row_end: int) -> tuple[list[int], int]:
    """Indices of the row groups that hold rows [row_start, row_end), and the first one's first row."""
    groups, first, offset = [], None, 0
    for i in range(meta.num_row_groups):
        n = meta.row_group(i).num_rows
        if offset < row_end and offset + n > row_start:
            groups.append(i)
            first = offset if first is None else first
        offset += n
    return groups, first or 0


class RowGroupCache:
    """Per-process memory of footers (by file) and of split row groups (by file, group, columns)."""

    def __init__(self, max_groups: int = 2, max_footers: int = 64) -> None:
        self.max_groups, self.max_footers = max_groups, max_footers
        self._footers: OrderedDict[str, pq.FileMetaData] = OrderedDict()
        self._groups: OrderedDict[tuple, pa.Table] = OrderedDict()
        self._lock = threading.Lock()
        self._key_locks: dict[Any, threading.Lock] = {}

    def footer(self, key: tuple, load: Callable[[], pq.FileMetaData]) -> pq.FileMetaData:
        """The cached footer for `key` = (url, file version), loaded once (concurrent callers wait for it)."""
        return self._get(self._footers, key, load, self.max_footers)

    def group(self, key: tuple, load: Callable[[], pa.Table]) -> pa.Table:
        """The cached decoded row group for `key` = (url, file version, group index, columns), loaded once."""
        return self._get(self._groups, key, load, self.max_groups)

    def _get(self, store: OrderedDict, key: Any, load: Callable[[], Any], limit: int) -> Any:
        with self._lock:
            key_lock = self._key_locks.setdefault((id(store), key), threading.Lock())
        with key_lock:
            with self._lock:
                if key in store:
                    store.move_to_end(key)
                    return store[key]
            value = load()
            with self._lock:
                store[key] = value
                while len(store) > limit:
                    old, _ = store.popitem(last=False)
                    self._key_locks.pop((id(store), old), None)
            return value


def read_range(open_file: Callable[[], Any], url: str, row_start: int, row_end: int, columns: list[str] | None,
               cache: RowGroupCache, stats: ReadStats | None = None, seen: dict[str, Any] | None = None) -> pa.Table:
    """Rows [row_start, row_end) of one Parquet file, only `columns` (None: all; see the module docstring). `seen` gets
    the size and stamps (etag / version id / mtime) of the version read, for the pin check."""
    with open_file() as raw:
        f = CountingFile(raw, stats)
        size = raw.seek(0, 2)
        if seen is not None:
            seen.update(size=size, stamps=file_stamps(raw))
        stamp = file_version(raw)
        if stamp is None:  # cannot tell a rewritten file from the one cached: do not cache this one
            cache = RowGroupCache(max_groups=0, max_footers=0)
        version = (url, size, stamp)
        meta = cache.footer(version, lambda: read_footer(raw, size, stats))
        groups, first = groups_for(meta, row_start, row_end)
        parquet = pq.ParquetFile(f, metadata=meta, pre_buffer=False)
        if len(groups) == 1 and _is_split(meta, groups[0], first, row_start, row_end):
            key = (*version, groups[0], None if columns is None else tuple(columns))
            table = cache.group(key, lambda: parquet.read_row_group(groups[0], columns=columns))
        elif groups:
            table = parquet.read_row_groups(groups, columns=columns)
        else:
            empty = parquet.schema_arrow.empty_table()
            table = empty if columns is None else empty.select(columns)
    return table.slice(row_start - first, row_end - row_start)


def file_stamps(f: Any) -> dict[str, str]:
    """What an open file's store says identifies this version of it, without an extra request: `etag`,
    `version_id` (versioned buckets), `mtime` (whichever the store gives)."""
    details = getattr(f, "details", None)
    out = stamps_of(details) if isinstance(details, dict) else {}
    if "mtime" not in out:
        try:
            out["mtime"] = str(os.fstat(f.fileno()).st_mtime_ns)
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            pass
    return out


def stamps_of(info: dict[str, Any]) -> dict[str, str]:
    """`etag`, `version_id`, `mtime` from a listing / info dict (the names differ between stores)."""
    out: dict[str, str] = {}
    for ours, names in (("etag", ("ETag", "etag", "md5Hash")), ("version_id", ("VersionId", "generation")),
                        ("mtime", ("LastModified", "mtime", "last_modified", "updated"))):
        value = next((info[n] for n in names if info.get(n) is not None), None)
        if value is not None:
            out[ours] = str(value).strip('"')
    return out


def file_version(f: Any) -> Any:
    """What changes when an open file is rewritten: its ETag / mtime from the open (no extra request)."""
    details = getattr(f, "details", None)
    if isinstance(details, dict):
        for name in ("ETag", "etag", "generation", "version_id", "LastModified", "mtime", "last_modified"):
            if details.get(name) is not None:
                return str(details[name])
    try:
        return os.fstat(f.fileno()).st_mtime_ns
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


def _is_split(meta: pq.FileMetaData, group: int, first: int, row_start: int, row_end: int) -> bool:
    """True when the range is a strict piece of one row group (other pieces will want the same group)."""
    return row_start > first or row_end < first + meta.row_group(group).num_rows
