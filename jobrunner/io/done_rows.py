"""Which input rows an incremental run takes: those whose ids are not done (io/done_ids.py).

Each input file is read once, a batch at a time: its id column (or, without one, the derived ids
`<file-stem>:<row>`, which a null id also gets, as the output does) and, when changed prompts are checked,
its request columns. A row whose id is done is skipped; if its request fingerprint (io/fingerprints.py)
differs from the one its output row carries, it is counted and listed as changed (still skipped: exactly
once by id); a done row whose output has no fingerprint is counted as unchecked. Memory per file: one bool
per row while it is read, then the taken rows (8 bytes each) only when some rows of the file are skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from jobrunner.io.done_ids import DoneIds
from jobrunner.io.fingerprints import request_fingerprints
from jobrunner.io.ids import BATCH_ROWS, ids_or_derived
from jobrunner.io.image_prints import ImagePrints
from jobrunner.io.reader import InputError, InputFile, _open_exact
from jobrunner.io.storage import StorageError, retry
from jobrunner.io.text_input import file_format, read_input_rows

MAX_LISTED_CHANGED = 20  # changed ids kept per file (all are counted)


@dataclass
class FileScan:
    """One input file against the done ids."""

    taken: np.ndarray | None  # int64 row numbers taken (ascending); None = every row
    num_rows: int
    num_skipped: int = 0
    skipped_by_source: dict[int, int] = field(default_factory=dict)  # source code -> rows skipped
    num_changed: int = 0  # done ids whose request changed (skipped, reported)
    changed: list[tuple[int, str]] = field(default_factory=list)  # (row, id) of the first MAX_LISTED_CHANGED
    num_unchecked: int = 0  # done ids whose output carries no fingerprint

    @property
    def num_taken(self) -> int:
        return self.num_rows - self.num_skipped


@dataclass(frozen=True)
class RequestColumns:
    """What a scan reads besides ids: the request columns (role -> column) and the job's prompt salt;
    `roles` empty: changed prompts are not checked."""

    roles: dict[str, str]
    salt: np.uint64
    images: ImagePrints | None = None  # referenced images hashed by content (io/image_prints.py)


def scan_file(f: InputFile, storage_options: dict[str, Any], fmt: str, id_column: str | None,
              done: DoneIds, request: RequestColumns) -> FileScan:
    """The rows of `f` to take, and what was skipped or changed; InputError names the file it cannot read."""
    skipped = np.zeros(f.num_rows, bool)
    scan = FileScan(taken=None, num_rows=f.num_rows)
    columns = list(dict.fromkeys(([id_column] if id_column else []) + list(request.roles.values())))
    try:
        for offset, table in _batches(f, storage_options, fmt, columns):
            _scan_batch(scan, skipped, offset, table, f, id_column, done, request)
    except (OSError, StorageError, pa.ArrowInvalid) as exc:
        raise InputError(f"input file {f.url}: cannot read its ids to skip the done rows ({exc})") from None
    scan.num_skipped = int(skipped.sum())
    if scan.num_skipped:
        scan.taken = np.flatnonzero(~skipped).astype(np.int64)
    return scan


def _scan_batch(scan: FileScan, skipped: np.ndarray, offset: int, table: pa.Table, f: InputFile,
                id_column: str | None, done: DoneIds, request: RequestColumns) -> None:
    ids = row_ids(table, offset, f.stem, id_column)
    positions, entries = done.lookup(ids)
    if not len(positions):
        return
    skipped[offset + positions] = True
    for source, n in zip(*np.unique(done.sources[entries], return_counts=True), strict=True):
        scan.skipped_by_source[int(source)] = scan.skipped_by_source.get(int(source), 0) + int(n)
    if not request.roles:
        return
    stored = done.fingerprints[entries]
    known = stored != 0
    scan.num_unchecked += int((~known).sum())
    images = (lambda t: request.images.row_hashes(t, f.url)) if request.images is not None else None
    now = request_fingerprints(table.take(pa.array(positions)), request.roles, request.salt, images)
    changed = np.flatnonzero(known & (now != stored))
    scan.num_changed += len(changed)
    for k in changed[:max(0, MAX_LISTED_CHANGED - len(scan.changed))].tolist():
        scan.changed.append((offset + int(positions[k]), str(ids[int(positions[k])].as_py())))


def row_ids(table: pa.Table, offset: int, stem: str, id_column: str | None) -> pa.Array:
    """The rows' ids as text: the id column's, or `<stem>:<row>` where there is none or it is null."""
    values = table.column(id_column) if id_column and id_column in table.column_names else None
    return ids_or_derived(values, stem, offset, table.num_rows)


def _batches(f: InputFile, storage_options: dict[str, Any], fmt: str,
             columns: list[str]) -> Iterator[tuple[int, pa.Table]]:
    """(first row, the next rows' `columns`) over the file's planned rows, a batch at a time."""
    if not f.num_rows:
        return
    if file_format(f.url, fmt) != "parquet":
        table = read_input_rows(f.url, storage_options, fmt, 0, f.num_rows, columns)
        for start in range(0, table.num_rows, BATCH_ROWS):
            yield start, table.slice(start, BATCH_ROWS)
        return
    present = [c for c in columns if c in f.column_types]
    if not present:  # derived ids only: nothing to read
        for start in range(0, f.num_rows, BATCH_ROWS):
            yield start, pa.table({"row": pa.nulls(min(BATCH_ROWS, f.num_rows - start))})
        return
    fs, path = url_to_fs(f.url, **storage_options)
    handle = retry(f"open {f.url}", lambda: _open_exact(fs, path))
    with handle:  # only the planned rows: an input.limit cut the file (row groups and rows)
        offset = 0
        parquet = pq.ParquetFile(handle, pre_buffer=False)
        for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=present,
                                          row_groups=range(len(f.row_group_num_rows))):
            table = pa.Table.from_batches([batch]).slice(0, max(0, f.num_rows - offset))
            if not table.num_rows:
                return
            yield offset, table
            offset += table.num_rows
