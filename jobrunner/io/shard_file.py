"""The shard table: one row per shard, held as columns (numpy in memory, one Parquet file on storage).

A job of 10^6 shards must not cost 10^6 Python objects (a dict per shard was ~3 kB each), so the driver keeps
every shard's state in `ShardColumns`: fixed-width arrays plus a few strings stored once (file URLs, worker
ids, error texts, error kinds), about 120 bytes a shard. The manifest's compaction writes them as
`_shards/<generation>.parquet` (schema in docs/contracts.md); reading it back builds no Python object per
shard either: dictionary-encoded columns come back as codes plus their distinct values. Format 1-2 manifests
(a JSON object per shard) convert with `from_entries`; `to_entries` gives those dicts back for small outputs,
tools and tests.
"""

from __future__ import annotations

import io
import json
from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from jobrunner.io.layout import part_key
from jobrunner.redaction import redact_text

STATUS_VALUES = ("pending", "committed", "failed")  # status codes 0, 1, 2
PENDING, COMMITTED, FAILED = 0, 1, 2
COUNT_COLUMNS = ("rows", "num_errors", "num_prompt_tokens", "num_cached_tokens", "num_output_tokens",
                 "attempts", "failures", "infra_failures",
                 "part_bytes",  # the bytes of a committed shard's parts, summed (a resume checks them; 0: unknown)
                 "num_samples")  # samples done, an error row counting as its n (progress_view.py; 0: unknown)
CODED_COLUMNS = ("file", "worker_id", "error")
# Entry keys with a column of their own (everything else an entry carries is kept in `extra`).
COLUMN_KEYS = frozenset(("shard_id", "status", "file", "row_start", "row_end", "seconds", "part", "parts",
                         "error_kinds", *COUNT_COLUMNS, *CODED_COLUMNS))


class Codes:
    """A string column stored once per distinct value: int32 codes (-1 = null) into `values`."""

    def __init__(self, codes: np.ndarray, values: list[str]) -> None:
        self.codes = codes  # int32 [num_shards]
        self.values = list(values)
        self._code_of = {v: i for i, v in enumerate(self.values)}

    def code_of(self, value: str | None) -> int:
        """The code of a value, adding it when new (-1 for None)."""
        if value is None:
            return -1
        code = self._code_of.get(value)
        if code is None:
            code = self._code_of[value] = len(self.values)
            self.values.append(value)
        return code

    def get(self, index: int) -> str | None:
        """The value of row `index`."""
        code = int(self.codes[index])
        return None if code < 0 else self.values[code]

    def copy(self) -> Codes:
        return Codes(self.codes.copy(), self.values)


class ErrorKinds:
    """Error kind -> rows, per committed shard, as (shard, kind code, rows) triples: 16 bytes per pair."""

    def __init__(self) -> None:
        self.shard, self.kind, self.count = array("i"), array("i"), array("q")
        self.kinds = Codes(np.zeros(0, np.int32), [])

    def add(self, index: int, kinds: dict[str, int]) -> None:
        """Record a shard's error kinds (the shard must have none recorded yet)."""
        for kind, n in kinds.items():
            self.shard.append(index)
            self.kind.append(self.kinds.code_of(str(kind)))
            self.count.append(int(n))

    def of(self, index: int) -> dict[str, int]:
        """One shard's error kinds (O(pairs): for single entries, not loops over shards)."""
        where = np.flatnonzero(np.frombuffer(self.shard, np.int32) == index) if len(self.shard) else []
        return {self.kinds.values[self.kind[i]]: int(self.count[i]) for i in where}

    def by_shard(self) -> dict[int, dict[str, int]]:
        """Every shard's error kinds (one pass)."""
        out: dict[int, dict[str, int]] = {}
        for index, code, n in zip(self.shard, self.kind, self.count, strict=True):
            out.setdefault(index, {})[self.kinds.values[code]] = n
        return out

    def drop(self, keep: np.ndarray) -> None:
        """Forget the pairs of every shard whose `keep` flag is False."""
        if not len(self.shard):
            return
        mask = keep[np.frombuffer(self.shard, np.int32)]
        for name in ("shard", "kind", "count"):
            old = getattr(self, name)
            setattr(self, name, array(old.typecode, np.frombuffer(old, _dtype(old))[mask].tobytes()))

    def totals(self, counted: np.ndarray) -> dict[str, int]:
        """kind -> rows over the shards whose `counted` flag is True, most frequent first."""
        if not len(self.shard):
            return {}
        shard = np.frombuffer(self.shard, np.int32)
        keep = counted[shard]
        sums = np.bincount(np.frombuffer(self.kind, np.int32)[keep], np.frombuffer(self.count, np.int64)[keep],
                           minlength=len(self.kinds.values))
        order = np.argsort(-sums, kind="stable")
        return {self.kinds.values[k]: int(sums[k]) for k in order if sums[k] > 0}

    def copy(self) -> ErrorKinds:
        out = ErrorKinds()
        out.shard, out.kind, out.count = array("i", self.shard), array("i", self.kind), array("q", self.count)
        out.kinds = Codes(out.kinds.codes, self.kinds.values)
        return out


def _dtype(values: array) -> type:
    return np.int32 if values.typecode == "i" else np.int64


@dataclass
class ShardColumns:
    """Every shard's plan and state, one row per shard, in plan order."""

    shard_id: np.ndarray  # bytes [n]: ASCII ids
    file: Codes
    row_start: np.ndarray  # int64 [n]
    row_end: np.ndarray  # int64 [n]
    status: np.ndarray  # int8 [n]: index into STATUS_VALUES
    counts: np.ndarray  # int64 [n, len(COUNT_COLUMNS)]
    seconds: np.ndarray  # float64 [n]: NaN = not run
    worker_id: Codes
    error: Codes
    error_kinds: ErrorKinds = field(default_factory=ErrorKinds)
    parts: dict[int, list[str]] = field(default_factory=dict)  # only shards whose parts are not the one default
    extra: dict[int, dict[str, Any]] = field(default_factory=dict)  # entry keys without a column, kept as is

    @classmethod
    def pending(cls, shard_ids: np.ndarray, file_codes: np.ndarray, file_urls: list[str], row_start: np.ndarray,
                row_end: np.ndarray) -> ShardColumns:
        """Every shard pending, nothing run."""
        n = len(shard_ids)
        return cls(shard_id=shard_ids, file=Codes(file_codes.astype(np.int32), file_urls),
                   row_start=row_start.astype(np.int64), row_end=row_end.astype(np.int64),
                   status=np.zeros(n, np.int8), counts=np.zeros((n, len(COUNT_COLUMNS)), np.int64),
                   seconds=np.full(n, np.nan), worker_id=Codes(np.full(n, -1, np.int32), []),
                   error=Codes(np.full(n, -1, np.int32), []))

    def __len__(self) -> int:
        return len(self.shard_id)

    @property
    def nbytes(self) -> int:
        """Bytes held by the per-shard arrays (the strings stored once and the sparse maps not counted)."""
        arrays = (self.shard_id, self.file.codes, self.row_start, self.row_end, self.status, self.counts,
                  self.seconds, self.worker_id.codes, self.error.codes)
        return sum(a.nbytes for a in arrays) + sum(len(a) * a.itemsize for a in
                                                    (self.error_kinds.shard, self.error_kinds.kind,
                                                     self.error_kinds.count))

    def id_of(self, index: int) -> str:
        return self.shard_id[index].decode()

    def parts_of(self, index: int) -> list[str]:
        """A committed shard's part keys (several when it was bisected); [] for one not committed."""
        if self.status[index] != COMMITTED:
            return []
        return self.parts.get(index) or [part_key(self.id_of(index))]

    def entry(self, index: int, error_kinds: dict[str, int] | None = None) -> dict[str, Any]:
        """One shard as its manifest entry / commit record (docs/contracts.md); file URLs redacted.
        `error_kinds`: the shard's, when the caller has them at hand."""
        seconds = float(self.seconds[index])
        parts = self.parts_of(index)
        entry: dict[str, Any] = {"status": STATUS_VALUES[self.status[index]], "file": _redacted(self.file.get(index)),
                                 "row_start": int(self.row_start[index]), "row_end": int(self.row_end[index])}
        entry.update(zip(COUNT_COLUMNS, (int(v) for v in self.counts[index]), strict=True))
        entry.update(worker_id=self.worker_id.get(index), seconds=None if np.isnan(seconds) else seconds,
                     error=self.error.get(index), part=parts[0] if parts else None, parts=parts,
                     error_kinds=error_kinds if error_kinds is not None else
                     self.error_kinds.of(index) if self.status[index] == COMMITTED else {})
        entry.update(self.extra.get(index, {}))
        return entry

    def set_entry(self, index: int, entry: dict[str, Any]) -> None:
        """Take a manifest entry or commit record into row `index` (the row's id and file stay)."""
        status = entry.get("status", "pending")
        self.status[index] = STATUS_VALUES.index(status) if status in STATUS_VALUES else PENDING
        self.counts[index] = [_count(entry.get(k)) for k in COUNT_COLUMNS]
        seconds = entry.get("seconds")
        self.seconds[index] = float(seconds) if isinstance(seconds, (int, float)) else np.nan
        self.worker_id.codes[index] = self.worker_id.code_of(_text(entry.get("worker_id")))
        self.error.codes[index] = self.error.code_of(_text(entry.get("error")))
        if self.status[index] == COMMITTED:
            self.error_kinds.add(index, entry.get("error_kinds") or {})
        parts = [str(p) for p in entry.get("parts") or ([entry["part"]] if entry.get("part") else [])]
        self._set_sparse(self.parts, index, parts if parts and parts != [part_key(self.id_of(index))] else None)
        extra = {k: v for k, v in entry.items() if k not in COLUMN_KEYS}
        self._set_sparse(self.extra, index, extra or None)

    def reset(self, indices: np.ndarray) -> None:
        """Make these shards pending, as if never run (their error kinds, parts and extras forgotten)."""
        if not len(indices):
            return
        self.status[indices] = PENDING
        self.counts[indices] = 0
        self.seconds[indices] = np.nan
        self.worker_id.codes[indices] = -1
        self.error.codes[indices] = -1
        keep = np.ones(len(self), bool)
        keep[indices] = False
        self.error_kinds.drop(keep)
        for mapping in (self.parts, self.extra):  # sparse: loop over what they hold, not over `indices`
            for index in [i for i in mapping if not keep[i]]:
                del mapping[index]

    def copy(self) -> ShardColumns:
        """A snapshot (the plan's arrays, which never change, are shared)."""
        return ShardColumns(shard_id=self.shard_id, file=Codes(self.file.codes, self.file.values),
                            row_start=self.row_start, row_end=self.row_end, status=self.status.copy(),
                            counts=self.counts.copy(), seconds=self.seconds.copy(), worker_id=self.worker_id.copy(),
                            error=self.error.copy(), error_kinds=self.error_kinds.copy(), parts=dict(self.parts),
                            extra=dict(self.extra))

    def reordered(self, order: np.ndarray) -> ShardColumns:
        """The same table with its rows permuted: row i of the result is row order[i] of this one."""
        new_index = np.empty(len(order), np.int64)
        new_index[order] = np.arange(len(order))
        kinds = self.error_kinds.copy()
        if len(kinds.shard):
            kinds.shard = array("i", new_index[np.frombuffer(kinds.shard, np.int32)].astype(np.int32).tobytes())
        return ShardColumns(shard_id=self.shard_id[order], file=Codes(self.file.codes[order], self.file.values),
                            row_start=self.row_start[order], row_end=self.row_end[order], status=self.status[order],
                            counts=self.counts[order], seconds=self.seconds[order],
                            worker_id=Codes(self.worker_id.codes[order], self.worker_id.values),
                            error=Codes(self.error.codes[order], self.error.values), error_kinds=kinds,
                            parts={int(new_index[i]): v for i, v in self.parts.items()},
                            extra={int(new_index[i]): v for i, v in self.extra.items()})

    def take(self, indices: np.ndarray) -> ShardColumns:
        """These rows only, in this order (an incremental run keeps the committed shards of earlier runs)."""
        indices = np.asarray(indices, np.int64)
        keep = np.zeros(len(self), bool)
        keep[indices] = True
        new_index = np.full(len(self), -1, np.int64)
        new_index[indices] = np.arange(len(indices))
        kinds = self.error_kinds.copy()
        kinds.drop(keep)
        if len(kinds.shard):
            kinds.shard = array("i", new_index[np.frombuffer(kinds.shard, np.int32)].astype(np.int32).tobytes())
        return ShardColumns(shard_id=self.shard_id[indices], file=Codes(self.file.codes[indices], self.file.values),
                            row_start=self.row_start[indices], row_end=self.row_end[indices],
                            status=self.status[indices], counts=self.counts[indices], seconds=self.seconds[indices],
                            worker_id=Codes(self.worker_id.codes[indices], self.worker_id.values),
                            error=Codes(self.error.codes[indices], self.error.values), error_kinds=kinds,
                            parts={int(new_index[i]): v for i, v in self.parts.items() if keep[i]},
                            extra={int(new_index[i]): v for i, v in self.extra.items() if keep[i]})

    def concat(self, other: ShardColumns) -> tuple[ShardColumns, list[int]]:
        """This table's rows, then `other`'s; and, per file code of `other`, its code in the result."""
        file_codes = Codes(self.file.codes, self.file.values)
        file_map = [file_codes.code_of(v) for v in other.file.values]
        out = ShardColumns(
            shard_id=np.concatenate([self.shard_id, other.shard_id]).astype(bytes),
            file=Codes(np.concatenate([self.file.codes, _recode(other.file.codes, file_map)]), file_codes.values),
            row_start=np.concatenate([self.row_start, other.row_start]),
            row_end=np.concatenate([self.row_end, other.row_end]),
            status=np.concatenate([self.status, other.status]), counts=np.concatenate([self.counts, other.counts]),
            seconds=np.concatenate([self.seconds, other.seconds]),
            worker_id=_concat_codes(self.worker_id, other.worker_id), error=_concat_codes(self.error, other.error),
            error_kinds=self.error_kinds.copy(), parts=dict(self.parts), extra=dict(self.extra))
        for index, kinds in other.error_kinds.by_shard().items():
            out.error_kinds.add(len(self) + index, kinds)
        out.parts.update({len(self) + i: v for i, v in other.parts.items()})
        out.extra.update({len(self) + i: v for i, v in other.extra.items()})
        return out, file_map

    def index_of(self, shard_id: str) -> int | None:
        """The row of an id of the form "<row>-<digest>" (how the driver names shards), else None."""
        head = shard_id.split("-", 1)[0]
        if head.isdigit() and int(head) < len(self) and self.shard_id[int(head)] == shard_id.encode():
            return int(head)
        return None

    @staticmethod
    def _set_sparse(mapping: dict, index: int, value: Any) -> None:
        if value is None:
            mapping.pop(index, None)
        else:
            mapping[index] = value


def _recode(codes: np.ndarray, mapping: list[int]) -> np.ndarray:
    """Codes into another value list (`mapping[old] = new`; -1 stays -1)."""
    table = np.array(mapping + [-1], np.int32)
    return table[codes].astype(np.int32)


def _concat_codes(first: Codes, second: Codes) -> Codes:
    merged = Codes(first.codes, first.values)
    mapping = [merged.code_of(v) for v in second.values]
    return Codes(np.concatenate([first.codes, _recode(second.codes, mapping)]), merged.values)


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _redacted(value: str | None) -> str | None:
    return None if value is None else redact_text(value)


# ---- Parquet ------------------------------------------------------------------------------------------------
def to_parquet(columns: ShardColumns) -> bytes:
    """The table as one Parquet file (status, file, worker_id and error dictionary-encoded)."""
    data = {"shard_id": pa.array(columns.shard_id, pa.binary()).cast(pa.string()),
            "status": _dictionary(columns.status.astype(np.int32), list(STATUS_VALUES)),
            "file": _dictionary(columns.file.codes, [redact_text(u) for u in columns.file.values]),
            "row_start": pa.array(columns.row_start), "row_end": pa.array(columns.row_end)}
    for k, name in enumerate(COUNT_COLUMNS):
        data[name] = pa.array(np.ascontiguousarray(columns.counts[:, k]))
    data["seconds"] = pa.array(columns.seconds, mask=np.isnan(columns.seconds))
    data["worker_id"] = _dictionary(columns.worker_id.codes, columns.worker_id.values)
    data["error"] = _dictionary(columns.error.codes, columns.error.values)
    data["error_kinds"] = _kinds_column(columns)
    data["parts"] = _sparse_column(columns.parts, len(columns), pa.list_(pa.string()))
    data["extra"] = _sparse_column({i: json.dumps(v) for i, v in columns.extra.items()}, len(columns), pa.string())
    sink = io.BytesIO()
    pq.write_table(pa.table(data), sink, compression="zstd")
    return sink.getvalue()


def _dictionary(codes: np.ndarray, values: list[str]) -> pa.DictionaryArray:
    indices = pa.array(codes.astype(np.int32), mask=codes < 0)
    return pa.DictionaryArray.from_arrays(indices, pa.array(values, pa.string()))


def _sparse_column(mapping: dict[int, Any], n: int, type_: pa.DataType) -> pa.Array:
    """A column null except at the rows in `mapping` (no per-shard Python list when the mapping is empty)."""
    if not mapping:
        return pa.nulls(n, type_)
    values: list[Any] = [None] * n
    for index, value in mapping.items():
        values[index] = value
    return pa.array(values, type_)


def _kinds_column(columns: ShardColumns) -> pa.Array:
    kinds = columns.error_kinds
    n = len(columns)
    kind_type = pa.struct([("kind", pa.string()), ("count", pa.int64())])
    shard = np.frombuffer(kinds.shard, np.int32) if len(kinds.shard) else np.zeros(0, np.int32)
    order = np.argsort(shard, kind="stable")
    per_shard = np.bincount(shard, minlength=n)
    offsets = np.concatenate([[0], np.cumsum(per_shard)]).astype(np.int32)
    kind_codes = np.frombuffer(kinds.kind, np.int32)[order] if len(shard) else np.zeros(0, np.int32)
    counts = np.frombuffer(kinds.count, np.int64)[order] if len(shard) else np.zeros(0, np.int64)
    names = pa.array(kinds.kinds.values, pa.string()).take(pa.array(kind_codes))
    values = pa.StructArray.from_arrays([names, pa.array(counts, pa.int64())], fields=list(kind_type))
    return pa.ListArray.from_arrays(pa.array(offsets), values, mask=pa.array(per_shard == 0))


def from_parquet(data: bytes) -> ShardColumns:
    """Read a table written by `to_parquet`."""
    table = pq.read_table(io.BytesIO(data), read_dictionary=list(CODED_COLUMNS) + ["status"])
    status_codes = _codes(table["status"])
    status_map = np.array([STATUS_VALUES.index(v) if v in STATUS_VALUES else PENDING
                           for v in status_codes.values] + [PENDING], np.int8)
    shard_ids = np.array(table["shard_id"].combine_chunks().cast(pa.binary()).to_numpy(zero_copy_only=False),
                         dtype=bytes)
    columns = ShardColumns(shard_id=shard_ids, file=_codes(table["file"]),
                           row_start=_numbers(table["row_start"], np.int64),
                           row_end=_numbers(table["row_end"], np.int64), status=status_map[status_codes.codes],
                           counts=np.stack([_numbers(table[k], np.int64) if k in table.column_names
                                            else np.zeros(table.num_rows, np.int64) for k in COUNT_COLUMNS], axis=1),
                           seconds=_numbers(table["seconds"], np.float64), worker_id=_codes(table["worker_id"]),
                           error=_codes(table["error"]))
    _read_kinds(columns, table["error_kinds"].combine_chunks())
    columns.parts = _read_sparse(table["parts"])
    columns.extra = {i: json.loads(v) for i, v in _read_sparse(table["extra"]).items()}
    return columns


def _codes(column: pa.ChunkedArray) -> Codes:
    array_ = column.combine_chunks()
    if not pa.types.is_dictionary(array_.type):
        array_ = pc.dictionary_encode(array_)
    codes = pc.fill_null(array_.indices.cast(pa.int32()), -1).to_numpy(zero_copy_only=False)
    return Codes(np.array(codes, np.int32), array_.dictionary.to_pylist())


def _count(value: Any) -> int:
    """A count column's value from an entry (a list, e.g. `part_bytes` per part in a commit record, is summed)."""
    if isinstance(value, (list, tuple)):
        return sum(int(v or 0) for v in value)
    return int(value or 0)


def _numbers(column: pa.ChunkedArray, dtype: type) -> np.ndarray:
    fill = np.nan if dtype is np.float64 else 0
    return np.array(pc.fill_null(column.combine_chunks(), fill).to_numpy(zero_copy_only=False), dtype)


def _read_sparse(column: pa.ChunkedArray) -> dict[int, Any]:
    column = column.combine_chunks()
    present = np.flatnonzero(pc.is_valid(column).to_numpy(zero_copy_only=False))
    return {int(i): column[int(i)].as_py() for i in present}


def _read_kinds(columns: ShardColumns, kinds: pa.ListArray) -> None:
    lengths = pc.fill_null(pc.list_value_length(kinds), 0).to_numpy(zero_copy_only=False)
    if not lengths.sum():
        return
    flat = pc.list_flatten(kinds)
    names, counts = flat.field("kind").to_pylist(), flat.field("count").to_numpy(zero_copy_only=False)
    shards = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
    for index, name, count in zip(shards.tolist(), names, counts.tolist(), strict=True):
        columns.error_kinds.add(index, {name: count})


# ---- format 1-2: one JSON object per shard ---------------------------------------------------------------
def from_entries(entries: dict[str, dict[str, Any]]) -> ShardColumns:
    """Columns from a format 1-2 manifest's `shards` object (shard id -> entry), in its order."""
    ids = list(entries)
    file_codes = Codes(np.zeros(0, np.int32), [])
    codes = np.array([file_codes.code_of(_text(e.get("file")) or "") for e in entries.values()], np.int32)
    columns = ShardColumns.pending(np.array([s.encode() for s in ids], dtype=bytes), codes, file_codes.values,
                                   np.array([int(e.get("row_start") or 0) for e in entries.values()], np.int64),
                                   np.array([int(e.get("row_end") or 0) for e in entries.values()], np.int64))
    for index, entry in enumerate(entries.values()):
        columns.set_entry(index, entry)
    return columns


def to_entries(columns: ShardColumns) -> dict[str, dict[str, Any]]:
    """shard id -> manifest entry for every shard: one dict each, so for small outputs, tools and tests."""
    kinds = columns.error_kinds.by_shard()
    return {columns.id_of(i): columns.entry(i, kinds.get(i, {})) for i in range(len(columns))}
