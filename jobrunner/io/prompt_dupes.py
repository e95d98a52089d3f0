"""Duplicate prompts of an input (`output.dedupe: prompts`): rows whose request repeats an earlier row's.

A row's request fingerprint (io/fingerprints.py: its prompt or messages, per-row sampling, system prompt,
template variables and tools, with the job's prompt settings as salt; its id left out) is what every output row
carries as `request_fingerprint`. Planning reads the request columns of every input file once, in file order,
and a row whose fingerprint an earlier row (in file order, then row order) already has is a duplicate of that
first row. The duplicates are stored under the output (`_plan/dedupe-prompts.parquet`: file, row, the first
row's id) before any worker starts; a worker writes each of them as a row of its own (finish_reason
`duplicate`, `dedupe_of` the first row's id) instead of generating it, so every input id still comes out
exactly once, and a retry, a resume or another worker reads the same list.

Exact up to the 64-bit fingerprint: two different requests share one with a chance of about n^2 / 2^65.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jobrunner.io.done_rows import _batches, row_ids
from jobrunner.io.fingerprints import request_fingerprints
from jobrunner.io.image_prints import ImagePrints
from jobrunner.io.reader import InputError, InputFile
from jobrunner.io.storage import Storage, StorageError

DUPLICATES_KEY = "_plan/dedupe-prompts.parquet"
_SCHEMA = pa.schema([("file", pa.string()), ("row", pa.int64()), ("dedupe_of", pa.string())])


@dataclass
class PromptDuplicates:
    """The input's duplicate rows: (file, row) and the id of the first row with the same request."""

    table: pa.Table  # file, row, dedupe_of
    num_rows: int  # input rows read
    num_distinct: int  # distinct requests among them

    @property
    def num_duplicates(self) -> int:
        return self.table.num_rows

    def describe(self) -> dict[str, int]:
        """The manifest's record of the plan."""
        return {"rows": self.num_rows, "distinct_prompts": self.num_distinct,
                "duplicate_prompts": self.num_duplicates}


def find_prompt_duplicates(files: list[InputFile], storage_options: dict[str, Any], fmt: str,
                           id_column: str | None, roles: dict[str, str], salt: np.uint64,
                           images: ImagePrints | None = None) -> PromptDuplicates:
    """Every row whose request fingerprint an earlier row has (files in order, rows in order); InputError names
    a file that cannot be read. ``images``: referenced images hashed by content (io/image_prints.py)."""
    columns = list(dict.fromkeys(([id_column] if id_column else []) + list(roles.values())))
    prints, ids, where = [], [], []
    for file_index, f in enumerate(files):
        try:
            for offset, table in _batches(f, storage_options, fmt, columns):
                hashes = (lambda t, url=f.url: images.row_hashes(t, url)) if images is not None else None
                prints.append(request_fingerprints(table, roles, salt, hashes))
                ids.append(row_ids(table, offset, f.stem, id_column))
                where.append(np.stack([np.full(table.num_rows, file_index, np.int64),
                                       np.arange(offset, offset + table.num_rows, dtype=np.int64)]))
        except (OSError, StorageError, pa.ArrowInvalid) as exc:
            raise InputError(f"input file {f.url}: cannot read its prompts to find duplicates ({exc})") from None
    if not prints:
        return PromptDuplicates(pa.table({n: [] for n in _SCHEMA.names}, schema=_SCHEMA), 0, 0)
    fingerprints = np.concatenate(prints)
    _, first, inverse = np.unique(fingerprints, return_index=True, return_inverse=True)
    first_of_row = first[inverse.reshape(-1)]  # each row's first row with its fingerprint (itself if first)
    dup = np.flatnonzero(first_of_row != np.arange(len(fingerprints)))
    files_rows = np.concatenate(where, axis=1)
    all_ids = pa.concat_arrays([a.cast(pa.string()) for a in ids])
    table = pa.table({"file": pa.array([files[i].url for i in files_rows[0, dup].tolist()], pa.string()),
                      "row": pa.array(files_rows[1, dup], pa.int64()),
                      "dedupe_of": all_ids.take(pa.array(first_of_row[dup], pa.int64()))}, schema=_SCHEMA)
    return PromptDuplicates(table, len(fingerprints), len(first))


def write_duplicates(storage: Storage, duplicates: PromptDuplicates) -> None:
    """Store the duplicates under the output, for the workers (before any starts)."""
    sink = io.BytesIO()
    pq.write_table(duplicates.table, sink)
    storage.write_atomic(DUPLICATES_KEY, sink.getvalue())


def read_duplicates(storage: Storage) -> dict[tuple[str, int], str]:
    """(file URL, row) -> the id of the first row with the same request, as planning stored it."""
    table = pq.read_table(io.BytesIO(storage.read_bytes(DUPLICATES_KEY)))
    return {(f, int(r)): first for f, r, first in zip(table.column("file").to_pylist(),
                                                      table.column("row").to_pylist(),
                                                      table.column("dedupe_of").to_pylist(), strict=True)}
