"""The row order of prefix-grouped input files, stored under the output, and reading a shard's rows by it.

A prefix-grouped file's shards are not row ranges of the file but ranges of positions in the file's row
order (the file's rows sorted by prefix key). The planner writes every such file's order, one after the
other, as little-endian int64 row numbers into one object, `_plan/rows-<digest>.bin` under the output (its
name carries the digest of its content, so a changed plan never reads another plan's order). A worker reads
its shard's slice of it (8 bytes a row, one ranged read) and then those rows of the input file.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import pyarrow as pa

from jobrunner.io.storage import Storage, retry
from jobrunner.io.text_input import file_format, read_input_rows

PLAN_DIR = "_plan"
ROW_BYTES = 8
READ_GAP_ROWS = 4096  # rows of a Parquet file further apart than this are read by separate range reads


class RowOrderWriter:
    """Appends files' row orders to a local file, then uploads it under the output."""

    def __init__(self, local_path: str) -> None:
        self.local_path = local_path
        self._file = open(local_path, "wb")  # noqa: SIM115 - closed in finish()/discard()
        self._digest = hashlib.sha1()
        self.num_rows = 0

    def append(self, rows: np.ndarray) -> None:
        """Add the next rows of the order."""
        data = np.ascontiguousarray(rows, dtype="<i8").tobytes()
        self._file.write(data)
        self._digest.update(data)
        self.num_rows += len(rows)

    def truncate(self, num_rows: int) -> None:
        """Drop what was appended after the first `num_rows` (a file whose order was not kept)."""
        self._file.flush()
        self._file.truncate(num_rows * ROW_BYTES)
        self._file.seek(num_rows * ROW_BYTES)
        self.num_rows = num_rows
        self._digest = hashlib.sha1()
        with open(self.local_path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                self._digest.update(block)

    def finish(self) -> str:
        """Close the local file; the key the order will have under the output."""
        self._file.close()
        return f"{PLAN_DIR}/rows-{self._digest.hexdigest()[:16]}.bin"

    def discard(self) -> None:
        """Close and delete the local file."""
        if not self._file.closed:
            self._file.close()
        if os.path.exists(self.local_path):
            os.remove(self.local_path)


def upload_row_order(storage: Storage, local_path: str, key: str) -> None:
    """Put the planned row order under the output (streamed from the local file) unless it is there already."""
    path = storage.path(key)
    size = os.path.getsize(local_path)
    info = None
    try:
        info = storage.fs.info(path)
    except FileNotFoundError:
        pass
    if info is not None and int(info.get("size") or -1) == size:
        return
    parent = path.rsplit("/", 1)[0]
    try:
        storage.fs.makedirs(parent, exist_ok=True)
    except OSError:
        pass  # object stores have no folders
    retry(f"write {storage.display(key)}", lambda: storage.fs.put_file(local_path, path))


def read_positions(storage: Storage, key: str, start: int, end: int) -> np.ndarray:
    """Row numbers at positions [start, end) of the stored order (file offsets already added)."""
    path = storage.path(key)
    data = retry(f"read {storage.display(key)}",
                 lambda: storage.fs.cat_file(path, start=start * ROW_BYTES, end=end * ROW_BYTES))
    if len(data) != (end - start) * ROW_BYTES:
        raise OSError(f"{storage.display(key)}: the planned row order is shorter than the plan says "
                      f"(positions {start}..{end}); the output was changed: rerun with output.mode=overwrite")
    return np.frombuffer(data, "<i8")


def read_rows_at(file_url: str, storage_options: dict[str, Any], fmt: str, rows: np.ndarray,
                 columns: list[str] | None, pin: dict[str, Any] | None = None) -> pa.Table:
    """These rows of an input file (any order given; returned in increasing row order), with ROW_INDEX and
    ROW_ERROR as `read_input_rows` gives them (`pin`: checked as there, InputChanged). A Parquet file is read
    in runs of nearby rows (whole row groups each); a text file is parsed once anyway."""
    rows = np.unique(rows)
    if not len(rows):
        return read_input_rows(file_url, storage_options, fmt, 0, 0, columns, pin)
    if file_format(file_url, fmt) == "parquet":
        breaks = np.flatnonzero(np.diff(rows) > READ_GAP_ROWS) + 1
        runs = np.split(rows, breaks)
    else:
        runs = [rows]
    tables = []
    for run in runs:
        first = int(run[0])
        table = read_input_rows(file_url, storage_options, fmt, first, int(run[-1]) + 1, columns, pin)
        tables.append(table.take(pa.array(run - first)))
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]
