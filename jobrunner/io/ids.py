"""Duplicate row ids across the whole input, found before any work, in memory bounded whatever the rows.

Each id (as text: an integer id 7 and a string id "7" are the same output id) is hashed to 64 bits with a
vectorised polynomial hash over its UTF-8 bytes (numpy on the Arrow buffers: no Python object per id). The
(hash, global row) pairs stay in memory up to BUCKET_RECORDS rows in all; above that they are spilled to
local disk by the hash's top bits, BUCKET_RECORDS-ish per bucket, and each bucket is then sorted on its own,
so memory holds one bucket (~32 MiB) plus one read batch, at 10^8 rows as at 10^3. Equal hashes are only
candidates: the candidates' ids are read again and compared as text, so a hash collision is never reported.
"""

from __future__ import annotations

import heapq
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from jobrunner.io.reader import InputFile
from jobrunner.io.storage import retry

RECORD = np.dtype([("hash", "<u8"), ("row", "<i8")])  # row: the row's position in the whole input
BUCKET_RECORDS = 1 << 21  # records per bucket on disk (32 MiB): the most held in memory at once
SPILL_RECORDS = 1 << 21  # records buffered before they are written out to their buckets
BATCH_ROWS = 1 << 15  # ids hashed at once
MAX_CANDIDATES = 1000  # equal-hash groups confirmed (the earliest repeats); far more than any report names
_ROWS_PER_GROUP = 64  # the first rows of a group confirmed: room for several strings sharing one hash
_BASE = np.uint64(0x100000001B3)  # odd multiplier of the polynomial hash (FNV's prime)
_powers = np.ones(1, dtype=np.uint64)


@dataclass(frozen=True)
class Duplicate:
    """An id found twice: its first row and the first row that repeats it (file index, row in the file)."""

    row_id: str
    first: tuple[int, int]
    again: tuple[int, int]
    derived: tuple[bool, bool] = (False, False)  # (first, again): a null id, whose derived id this is


class IdSource(Protocol):
    """How the ids of one input file are read: all of them in batches, or a few rows."""

    def scan(self, f: InputFile) -> Iterator[tuple[int, pa.Array]]:
        """(first row, ids of the next rows) batch after batch, in row order (nulls allowed: skipped)."""

    def values(self, f: InputFile, rows: list[int]) -> dict[int, Any]:
        """Row in the file -> id, for a few rows."""


class NullsDerived:
    """An IdSource whose null ids read as the ids the output gives those rows, `<file-stem>:<row>` (a
    derived id may equal a real one: the duplicate check must see it before any work)."""

    def __init__(self, inner: IdSource) -> None:
        self.inner = inner

    def scan(self, f: InputFile) -> Iterator[tuple[int, pa.Array]]:
        for offset, ids in self.inner.scan(f):
            yield offset, ids_or_derived(ids, f.stem, offset, len(ids))

    def values(self, f: InputFile, rows: list[int]) -> dict[int, Any]:
        return {row: f"{f.stem}:{row}" if value is None else value
                for row, value in self.inner.values(f, rows).items()}


def find_duplicate_ids(files: list[InputFile], source: Callable[[InputFile], IdSource], limit: int = 10,
                       spill_dir: str | None = None) -> list[Duplicate]:
    """Up to `limit` duplicated ids, the earliest repeats first (by the position of the repeating row).
    `source(file)` reads that file's ids."""
    starts = np.cumsum([0] + [f.num_rows for f in files])
    table = _HashTable(int(starts[-1]), spill_dir)
    try:
        for index, f in enumerate(files):
            for offset, ids in source(f).scan(f):
                hashes, positions = hash_ids(ids)
                table.add(hashes, positions + starts[index] + offset)
        candidates = table.candidate_groups()
    finally:
        table.close()
    return _confirm(candidates, files, starts, source, limit)


def derived_ids(stem: str, start: int, count: int) -> pa.Array:
    """The ids `<stem>:<row>` of rows start..start+count-1 of a file: what a row without an id (no id column,
    or a null id) is called in the output (driver/rows.py: row_id), as large strings."""
    rows = pc.cast(pa.array(np.arange(start, start + count, dtype=np.int64)), pa.large_string())
    text = pa.large_string()
    return pc.binary_join_element_wise(pa.scalar(stem, text), rows, pa.scalar(":", text))


def ids_or_derived(ids: pa.Array | pa.ChunkedArray | None, stem: str, start: int, count: int) -> pa.Array:
    """The rows' output ids as large strings: each id as text, a null (or no ids at all) its derived id."""
    if ids is None:
        return derived_ids(stem, start, count)
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks() if ids.num_chunks != 1 else ids.chunk(0)
    text = pc.cast(ids, pa.large_string())
    if ids.null_count == 0:
        return text
    return pc.coalesce(text, derived_ids(stem, start, count))


def hash_ids(ids: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(64-bit hash of each non-null id as text, the ids' positions in `ids`)."""
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks() if ids.num_chunks != 1 else ids.chunk(0)
    valid = np.asarray(ids.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    positions = np.flatnonzero(valid)
    text = pc.cast(ids.filter(pa.array(valid)) if len(positions) < len(ids) else ids, pa.large_string())
    return _hash_strings(text), positions


def _hash_strings(text: pa.Array) -> np.ndarray:
    """sum((byte_i + 1) * BASE**i) mod 2**64 per string, mixed with its length and a splitmix64 finaliser."""
    if len(text) == 0:
        return np.empty(0, dtype=np.uint64)
    offsets = np.frombuffer(text.buffers()[1], dtype=np.int64)[text.offset:text.offset + len(text) + 1]
    base, lengths = offsets[0], np.diff(offsets)
    buffer = text.buffers()[2]
    data = np.frombuffer(buffer, dtype=np.uint8)[base:offsets[-1]] if buffer is not None else np.empty(0, np.uint8)
    within = np.arange(len(data), dtype=np.int64) - np.repeat(offsets[:-1] - base, lengths)
    terms = (data.astype(np.uint64) + np.uint64(1)) * _powers_upto(int(lengths.max(initial=0)))[within]
    sums = np.concatenate([np.zeros(1, np.uint64), np.cumsum(terms, dtype=np.uint64)])
    hashes = sums[offsets[1:] - base] - sums[offsets[:-1] - base]
    return _mix(hashes ^ (lengths.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)))


def _powers_upto(n: int) -> np.ndarray:
    global _powers
    if len(_powers) < n:
        _powers = np.cumprod(np.concatenate([np.ones(1, np.uint64), np.full(n, _BASE, np.uint64)]), dtype=np.uint64)
    return _powers


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class _HashTable:
    """(hash, row) records: in memory for a small input, else spilled to local files by the hash's top bits."""

    def __init__(self, num_rows: int, spill_dir: str | None) -> None:
        buckets = -(-num_rows // BUCKET_RECORDS)
        self.bits = max(0, (buckets - 1).bit_length()) if buckets > 1 else 0
        self.buffered: list[np.ndarray] = []
        self.num_buffered = 0
        self.dir = tempfile.mkdtemp(prefix="jobrunner-ids-", dir=spill_dir) if self.bits else None

    def add(self, hashes: np.ndarray, rows: np.ndarray) -> None:
        records = np.empty(len(hashes), RECORD)
        records["hash"], records["row"] = hashes, rows
        self.buffered.append(records)
        self.num_buffered += len(records)
        if self.bits and self.num_buffered >= SPILL_RECORDS:
            self._spill()

    def _spill(self) -> None:
        records = np.concatenate(self.buffered) if self.buffered else np.empty(0, RECORD)
        self.buffered, self.num_buffered = [], 0
        bucket = (records["hash"] >> np.uint64(64 - self.bits)).astype(np.int64)
        order = np.argsort(bucket, kind="stable")
        records, bucket = records[order], bucket[order]
        bounds = np.searchsorted(bucket, np.arange((1 << self.bits) + 1))
        for b in np.flatnonzero(np.diff(bounds)):
            with open(os.path.join(self.dir, f"{b:05d}"), "ab") as fh:
                records[bounds[b]:bounds[b + 1]].tofile(fh)

    def _buckets(self) -> Iterator[np.ndarray]:
        if not self.bits:
            yield np.concatenate(self.buffered) if self.buffered else np.empty(0, RECORD)
            return
        self._spill()
        for name in sorted(os.listdir(self.dir)):
            yield np.fromfile(os.path.join(self.dir, name), dtype=RECORD)

    def candidate_groups(self) -> list[np.ndarray]:
        """The rows of each group of equal hashes (up to _ROWS_PER_GROUP, ascending), the MAX_CANDIDATES
        groups whose second row comes first."""
        best: list[tuple[int, int, np.ndarray]] = []  # (-second row, tie, rows): a max-heap of the earliest
        for records in self._buckets():
            for second, rows in _groups(records):
                item = (-second, len(best), rows)
                if len(best) < MAX_CANDIDATES:
                    heapq.heappush(best, item)
                elif -second > best[0][0]:
                    heapq.heapreplace(best, item)
        return [rows for _, _, rows in sorted(best, key=lambda x: -x[0])]

    def close(self) -> None:
        self.buffered = []
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def _groups(records: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(second row, first rows) of each run of equal hashes in one bucket, the earliest MAX_CANDIDATES."""
    if len(records) < 2:
        return
    records = records[np.lexsort((records["row"], records["hash"]))]
    hashes, rows = records["hash"], records["row"]
    repeat = np.flatnonzero(hashes[1:] == hashes[:-1]) + 1  # rows equal in hash to the one before
    if not len(repeat):
        return
    starts = repeat[np.concatenate([[True], repeat[1:] != repeat[:-1] + 1])] - 1  # first row of each group
    seconds = rows[starts + 1]
    if len(starts) > MAX_CANDIDATES:
        keep = np.argpartition(seconds, MAX_CANDIDATES)[:MAX_CANDIDATES]
        starts, seconds = starts[keep], seconds[keep]
    for start, second in zip(starts.tolist(), seconds.tolist(), strict=True):
        end = start + 1
        while end < len(hashes) and end - start < _ROWS_PER_GROUP and hashes[end] == hashes[start]:
            end += 1
        yield second, rows[start:end]


def _confirm(groups: list[np.ndarray], files: list[InputFile], starts: np.ndarray,
             source: Callable[[InputFile], IdSource], limit: int) -> list[Duplicate]:
    """The groups' ids read again and compared as text: real duplicates only, earliest repeat first."""
    text = _ids_at(sorted({int(r) for rows in groups for r in rows}), files, starts, source)
    found: list[tuple[int, Duplicate]] = []
    for rows in groups:
        first_of: dict[str, int] = {}
        reported: set[str] = set()
        for row in (int(r) for r in rows):
            value = text[row]
            if value in first_of and value not in reported:
                found.append((row, Duplicate(value, _where(first_of[value], starts), _where(row, starts))))
                reported.add(value)
            first_of.setdefault(value, row)
    return [d for _, d in sorted(found, key=lambda x: x[0])][:limit]


def _where(row: int, starts: np.ndarray) -> tuple[int, int]:
    index = int(np.searchsorted(starts, row, side="right")) - 1
    return index, row - int(starts[index])


def _ids_at(rows: list[int], files: list[InputFile], starts: np.ndarray,
            source: Callable[[InputFile], IdSource]) -> dict[int, str]:
    """Global row -> id as text, for a few rows."""
    by_file: dict[int, list[int]] = {}
    for row in rows:
        index, within = _where(row, starts)
        by_file.setdefault(index, []).append(within)
    out: dict[int, str] = {}
    for index, within in by_file.items():
        f = files[index]
        for row, value in source(f).values(f, within).items():
            out[int(starts[index]) + row] = str(value)
    return out


class ParquetIds:
    """The id column of a Parquet file: streamed batch by batch; a few rows read from their row groups."""

    def __init__(self, storage_options: dict[str, Any], column: str) -> None:
        self.storage_options, self.column = storage_options, column

    def scan(self, f: InputFile) -> Iterator[tuple[int, pa.Array]]:
        fs, path = url_to_fs(f.url, **self.storage_options)
        fh = retry(f"open {f.url}", lambda: fs.open(path, "rb"))
        with fh:  # only the file's planned rows: an input.limit cut it (row groups and rows)
            offset, groups = 0, range(len(f.row_group_num_rows))
            for batch in pq.ParquetFile(fh).iter_batches(batch_size=BATCH_ROWS, columns=[self.column],
                                                         row_groups=groups):
                ids = batch.column(0).slice(0, max(0, f.num_rows - offset))
                if not len(ids):
                    return
                yield offset, ids
                offset += len(ids)

    def values(self, f: InputFile, rows: list[int]) -> dict[int, Any]:
        fs, path = url_to_fs(f.url, **self.storage_options)
        bounds = np.cumsum([0, *f.row_group_num_rows])
        by_group: dict[int, list[int]] = {}
        for row in rows:
            by_group.setdefault(int(np.searchsorted(bounds, row, side="right")) - 1, []).append(row)

        def load() -> dict[int, Any]:
            with fs.open(path, "rb") as fh:
                pf, out = pq.ParquetFile(fh), {}
                for group, members in by_group.items():
                    ids = pf.read_row_group(group, columns=[self.column]).column(0)
                    out.update({row: ids[row - int(bounds[group])].as_py() for row in members})
                return out

        return retry(f"read {f.url}", load)
