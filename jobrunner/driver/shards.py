"""Shard planning: cut the input files into row ranges of about N rows, with stable ids; the shard table.

A shard is (file, row_start, row_end). Boundaries follow row groups when they are small enough (so a shard
reads whole row groups), and split a big row group into even pieces; a worker fetches a split group once for
all the pieces it runs (io/row_groups.py), so no byte is fetched once per shard. The id hashes the file's position and
name and the range, so the same input and rows_per_shard always give the same shards, and a changed
plan is detected.

The plan is a `ShardTable`, the driver's one record of every shard: the plan (id, file, rows) and the state,
as columns (`io.shard_file.ShardColumns`, numpy arrays, ~120 bytes a shard) with what the job loop asks of
it: a shard's row from its id, the shards still to run, a failure or a commit, totals. `Shard` objects exist
only for the shards handed to a worker, and tasks only for the shards being worked on (driver/tasks.py), so
the driver's memory per shard is this table's, whatever the job's size.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from jobrunner.io.reader import InputFile, file_pin
from jobrunner.io.shard_file import COMMITTED, COUNT_COLUMNS, FAILED, PENDING, ShardColumns
from jobrunner.redaction import redact_text


@dataclass(frozen=True)
class Shard:
    """A row range of one input file: the unit of work, retry and output (one part per shard)."""

    shard_id: str
    file_url: str
    file_stem: str
    row_start: int
    row_end: int
    pin: dict[str, Any] | None = None  # the file's version at planning (io/reader.py: file_pin), checked on read
    # A prefix-grouped file (driver/prefix_plan.py): row_start/row_end are positions in the file's row order,
    # stored under the output at `order_key`, the file's order starting at position `order_offset`.
    order_key: str | None = None
    order_offset: int = 0

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start

    def to_dict(self) -> dict:
        return asdict(self)


def plan_shards(files: list[InputFile], rows_per_shard: int) -> ShardTable:
    """Shards of every file, in file order, all pending."""
    ids: list[bytes] = []
    file_codes: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    for file_index, f in enumerate(files):
        for start, end in _ranges(f.row_group_num_rows, rows_per_shard):
            ids.append(shard_id(len(ids), file_index, f, start, end).encode())
            file_codes.append(file_index)
            starts.append(start)
            ends.append(end)
    columns = ShardColumns.pending(np.array(ids, dtype=bytes), np.array(file_codes, np.int32),
                                   [f.url for f in files], np.array(starts, np.int64), np.array(ends, np.int64))
    return ShardTable(columns, [f.stem for f in files], [file_pin(f) for f in files])


def _ranges(group_rows: tuple[int, ...], target: int) -> list[tuple[int, int]]:
    """Row ranges: consecutive row groups packed up to `target` rows; big groups split evenly."""
    ranges: list[tuple[int, int]] = []
    start = offset = 0
    for n in group_rows:
        if n > target:
            if offset > start:
                ranges.append((start, offset))
            ranges.extend(_split(offset, n, target))
            start = offset + n
        elif offset + n - start > target:
            ranges.append((start, offset))
            start = offset
        offset += n
    if offset > start:
        ranges.append((start, offset))
    return ranges


def _split(offset: int, n: int, target: int) -> list[tuple[int, int]]:
    pieces = -(-n // target)
    bounds = [offset + n * i // pieces for i in range(pieces + 1)]
    return list(zip(bounds, bounds[1:], strict=False))


def shard_id(index: int, file_index: int, f: InputFile, start: int, end: int) -> str:
    """The stable id of shard `index`: "<index>-<8 hex digits>"."""
    # The file's position and name (not its absolute URL) so a job moved to another machine keeps its ids.
    name = f.url.rsplit("/", 1)[-1]
    digest = hashlib.sha1(f"{file_index}|{name}|{start}|{end}".encode()).hexdigest()[:8]
    return f"{index:05d}-{digest}"


TOTAL_COLUMNS = ("rows", "num_errors", "num_prompt_tokens", "num_cached_tokens", "num_output_tokens")


class ShardTable:
    """Every shard of a job, in plan order; shard i is row i of `columns`."""

    def __init__(self, columns: ShardColumns, file_stems: list[str],
                 file_pins: list[dict[str, Any]] | None = None) -> None:
        self.columns = columns
        self.file_stems = file_stems  # per file code: the stem derived row ids use
        self.file_pins = file_pins  # per file code: its version at planning, which workers check on read
        self.order_key: str | None = None  # the planned row order under the output (prefix-grouped files)
        self.order_offsets: list[int | None] = []  # per file code: where its order starts; None = row ranges
        self._index_of: dict[str, int] | None = None  # only for ids not of the form "<index>-<digest>"

    @classmethod
    def from_shards(cls, shards: list[Shard]) -> ShardTable:
        """A table of these shards, all pending (for tools and tests; planning builds its table directly)."""
        urls = list(dict.fromkeys(s.file_url for s in shards))
        stems = {s.file_url: s.file_stem for s in shards}
        code = {url: i for i, url in enumerate(urls)}
        columns = ShardColumns.pending(np.array([s.shard_id.encode() for s in shards], dtype=bytes),
                                       np.array([code[s.file_url] for s in shards], np.int32), urls,
                                       np.array([s.row_start for s in shards], np.int64),
                                       np.array([s.row_end for s in shards], np.int64))
        return cls(columns, [stems[url] for url in urls])

    def __len__(self) -> int:
        return len(self.columns)

    def extend(self, shard_ids: list[str], file_urls: list[str], num_rows: list[int]) -> range:
        """Append pending shards, each all the rows of its own file (a pipeline stage's feed: one shard per
        committed shard of the previous stage, driver/stage_feed.py); their table rows. File pins are not
        kept for them: a stage's input files are written once and never rewritten (io/stage_input.py)."""
        start = len(self)
        new = ShardColumns.pending(np.array([s.encode() for s in shard_ids], dtype=bytes),
                                   np.arange(len(file_urls), dtype=np.int32), list(file_urls),
                                   np.zeros(len(num_rows), np.int64), np.array(num_rows, np.int64))
        self.columns, file_map = self.columns.concat(new)
        for url, code in zip(file_urls, file_map, strict=True):
            if code >= len(self.file_stems):
                self.file_stems.append(url.rsplit("/", 1)[-1].removesuffix(".parquet"))
                if self.file_pins is not None:
                    self.file_pins.append(None)
        self._index_of = None
        return range(start, len(self))

    def id_of(self, index: int) -> str:
        return self.columns.id_of(index)

    def index_of(self, shard_id: str) -> int:
        """The row of a shard id; KeyError when the job has no such shard."""
        index = self.columns.index_of(shard_id)
        if index is not None:
            return index
        if self._index_of is None:
            self._index_of = {self.id_of(i): i for i in range(len(self))}
        return self._index_of[shard_id]

    def file_of(self, index: int) -> tuple[str, str]:
        """(URL, stem) of the shard's input file."""
        code = int(self.columns.file.codes[index])
        return self.columns.file.values[code], self.file_stems[code]

    def rows_of(self, index: int) -> tuple[int, int]:
        return int(self.columns.row_start[index]), int(self.columns.row_end[index])

    def shard(self, index: int, row_start: int | None = None, row_end: int | None = None) -> Shard:
        """Shard `index` as a worker gets it (or the piece [row_start, row_end) of it)."""
        start, end = self.rows_of(index)
        url, stem = self.file_of(index)
        code = int(self.columns.file.codes[index])
        pin = self.file_pins[code] if self.file_pins else None
        offset = self.order_offsets[code] if code < len(self.order_offsets) else None
        return Shard(self.id_of(index), url, stem, start if row_start is None else row_start,
                     end if row_end is None else row_end, pin, None if offset is None else self.order_key,
                     offset or 0)

    def __getitem__(self, index: int) -> Shard:
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        return self.shard(index % len(self))

    def __iter__(self) -> Iterator[Shard]:
        """Shard objects one at a time (for small plans and tests; the driver never iterates)."""
        return (self.shard(i) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        """Same plan: ids, files and row ranges."""
        if not isinstance(other, ShardTable):
            return NotImplemented
        mine, theirs = self.columns, other.columns
        return (np.array_equal(mine.shard_id, theirs.shard_id) and np.array_equal(mine.row_start, theirs.row_start)
                and np.array_equal(mine.row_end, theirs.row_end)
                and np.array_equal(mine.file.codes, theirs.file.codes) and mine.file.values == theirs.file.values
                and self.file_stems == other.file_stems)

    __hash__ = None  # type: ignore[assignment]  # mutable

    def status_of(self, index: int) -> int:
        return int(self.columns.status[index])

    def todo(self) -> np.ndarray:
        """Indices of the shards not committed, in plan order."""
        return np.flatnonzero(self.columns.status != COMMITTED)

    def commit(self, index: int, record: dict[str, Any]) -> None:
        """Take a committed shard's record."""
        self.columns.set_entry(index, record)

    def fail(self, index: int, error: str, attempts: int, failed: bool) -> None:
        """A failed attempt (redacted error); `failed` marks the shard failed for good."""
        self.columns.status[index] = FAILED if failed else PENDING
        self.columns.counts[index, COUNT_COLUMNS.index("attempts")] = attempts
        self.columns.error.codes[index] = self.columns.error.code_of(redact_text(error))

    def mark_not_run(self, indices: np.ndarray, error: str) -> None:
        """Shards left pending because the job stopped: one error text, stored once."""
        indices = indices[self.columns.status[indices] == PENDING]
        self.columns.error.codes[indices] = self.columns.error.code_of(redact_text(error))

    def adopt(self, old: ShardColumns) -> None:
        """Take the state of an earlier run's table holding the same shard ids (in any order)."""
        old = old.reordered(_positions(old.shard_id, self.columns.shard_id))
        own = self.columns
        own.status, own.counts, own.seconds = old.status, old.counts, old.seconds
        own.worker_id, own.error, own.error_kinds = old.worker_id, old.error, old.error_kinds
        own.parts, own.extra = old.parts, old.extra

    def totals(self) -> dict[str, Any]:
        """Sums over committed shards and shard counts (vectorized: O(shards) in numpy, no Python loop)."""
        committed = self.columns.status == COMMITTED
        sums = self.columns.counts[committed].sum(axis=0) if committed.any() else np.zeros(len(COUNT_COLUMNS))
        totals: dict[str, Any] = {k: int(sums[COUNT_COLUMNS.index(k)]) for k in TOTAL_COLUMNS}
        totals.update(shards_committed=int(committed.sum()),
                      shards_failed=int((self.columns.status == FAILED).sum()), shards_total=len(self))
        totals["error_kinds"] = self.columns.error_kinds.totals(committed)
        return totals

    def committed_parts(self) -> list[str]:
        """Part keys of every committed shard, in shard id order."""
        committed = np.flatnonzero(self.columns.status == COMMITTED)
        ordered = committed[np.argsort(self.columns.shard_id[committed], kind="stable")]
        return [p for i in ordered.tolist() for p in self.columns.parts_of(i)]


def _positions(old_ids: np.ndarray, new_ids: np.ndarray) -> np.ndarray:
    """order such that old_ids[order] == new_ids (the two hold the same ids)."""
    if len(old_ids) == len(new_ids) and np.array_equal(old_ids, new_ids):
        return np.arange(len(new_ids))
    old_sorted = np.argsort(old_ids, kind="stable")
    where = np.searchsorted(old_ids[old_sorted], new_ids)
    return old_sorted[where]
