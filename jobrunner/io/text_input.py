"""JSONL, CSV and OpenAI-batch input files, next to Parquet: listing, row counts, column types, row ranges.

`input.format` picks the reader; `auto` goes by each file's extension. A text file has no row groups, so the
planner sees it as one group of all its rows and a shard reads the file and keeps its row range. A JSONL or
CSV file is read by pyarrow's columnar reader when it reads cleanly; a file that does not (one value of the
wrong type, bytes that are not UTF-8, a line that is not a JSON object) is read line by line instead
(io/text_lines.py), where each bad line becomes that row's error (column ROW_ERROR, naming the line) and the
rest runs. OpenAI batch files are always read line by line: each line is one request.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import io
import json
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson
from fsspec.core import url_to_fs

from jobrunner.io.csv_records import csv_shape
from jobrunner.io.ids import BATCH_ROWS, Duplicate, IdSource, NullsDerived, ParquetIds, find_duplicate_ids
from jobrunner.io.reader import (
    PARQUET_SUFFIXES,
    ROW_ERROR,
    ROW_INDEX,
    InputError,
    InputFile,
    _expand,
    _read_footer,
    check_pin,
    file_stem,
    gone_message,
    map_files,
    read_rows,
)
from jobrunner.io.row_groups import stamps_of
from jobrunner.io.storage import StorageError, retry
from jobrunner.io.text_lines import csv_by_line, jsonl_by_line, openai_by_line, row_line_numbers
from jobrunner.redaction import redact_text, redacting_logger

log = redacting_logger(__name__)
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
CSV_SUFFIXES = (".csv",)
SHOWN_BAD_LINES = 3  # bad lines a file's description (validate) quotes


def file_format(path: str, fmt: str) -> str:
    """The format of one input file: `fmt` unless it is auto, then by extension (unknown: parquet)."""
    if fmt != "auto":
        return fmt
    if path.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if path.endswith(CSV_SUFFIXES):
        return "csv"
    return "parquet"


def list_input(url: str, storage_options: dict[str, Any], fmt: str) -> list[InputFile]:
    """The dataset's files of `fmt` (a file, a directory, or a glob), sorted, with row counts and columns."""
    try:
        fs, root = url_to_fs(url, **storage_options)
    except (ImportError, ValueError) as exc:
        raise InputError(f"input.url {url!r}: {exc}") from None
    path_to_size = _expand(fs, url, root, _suffixes(fmt))
    if not path_to_size:
        raise InputError(f"input.url {url!r}: no {_describe(fmt)} files found")
    # footers / text files described concurrently: a few small reads each, dominated by latency
    return map_files(lambda p: _describe_file(fs, p, file_format(p, fmt), path_to_size[p]), list(path_to_size))


def _suffixes(fmt: str) -> tuple[str, ...]:
    return {"parquet": PARQUET_SUFFIXES, "csv": CSV_SUFFIXES, "jsonl": JSONL_SUFFIXES,
            "openai_batch": JSONL_SUFFIXES}.get(fmt, PARQUET_SUFFIXES + JSONL_SUFFIXES + CSV_SUFFIXES)


def _describe(fmt: str) -> str:
    return "input (.parquet, .jsonl, .csv)" if fmt == "auto" else fmt


def _describe_file(fs: Any, path: str, fmt: str, size: int | None = None) -> InputFile:
    if fmt == "parquet":
        return _read_footer(fs, path, size)
    url = fs.unstrip_protocol(path)
    stamps = _stamps(fs, path, url)
    data = _read_bytes(fs, path, url)
    table = _parse(data, fmt, url)
    errors = table.column(ROW_ERROR).drop_null() if ROW_ERROR in table.column_names else pa.array([], pa.string())
    return InputFile(url=url, stem=file_stem(path), num_rows=table.num_rows,
                     row_group_num_rows=(table.num_rows,) if table.num_rows else (),
                     column_types={f.name: str(f.type) for f in table.schema if f.name != ROW_ERROR},
                     num_bytes=len(data), stamps=stamps, digest=hashlib.sha1(data).hexdigest()[:20],
                     num_bad_lines=len(errors), first_bad_lines=tuple(errors[:SHOWN_BAD_LINES].to_pylist()))


def _stamps(fs: Any, path: str, url: str) -> dict[str, str]:
    """A text file's ETag / version id / mtime, from its info (io/row_groups.py: file_stamps)."""
    try:
        info = retry(f"inspect {url}", lambda: fs.info(path))
    except FileNotFoundError:
        raise InputError(gone_message(url)) from None
    except (OSError, StorageError) as exc:
        raise InputError(f"input file {url}: cannot read: {exc}") from None
    return stamps_of(info)


def read_input_rows(file_url: str, storage_options: dict[str, Any], fmt: str, row_start: int, row_end: int,
                    columns: list[str] | None, pin: dict[str, Any] | None = None) -> pa.Table:
    """Rows [row_start, row_end) of one input file of any format: `columns` (None: all) plus ROW_ERROR (why
    a text line could not be read; null for every Parquet row) and ROW_INDEX. `pin` (io/reader.py: file_pin):
    InputChanged when the file is no longer the version planning saw."""
    fmt = file_format(file_url, fmt)
    if fmt == "parquet":
        wanted = None if columns is None else [c for c in columns if c != ROW_ERROR]
        table = read_rows(file_url, storage_options, row_start, row_end, wanted, pin=pin)
        if ROW_ERROR in table.column_names:  # a pipeline stage's input carries each row's error (io/stage_input.py)
            return table
        errors = pa.nulls(table.num_rows, pa.string())
        return table.add_column(table.num_columns - 1, ROW_ERROR, errors)
    options = json.dumps(storage_options, sort_keys=True, default=str)
    info = _info(file_url, storage_options)
    stamp = info.get("mtime") or info.get("LastModified") or info.get("ETag") or info.get("updated")
    table, digest = _parsed_file(file_url, options, fmt, f"{info.get('size')}|{stamp}")
    if pin:
        check_pin(file_url, pin, info.get("size"), stamps_of(info), lambda: digest)
    table = table.slice(row_start, row_end - row_start)
    if ROW_ERROR not in table.column_names:
        table = table.append_column(ROW_ERROR, pa.nulls(table.num_rows, pa.string()))
    if columns is not None:
        table = table.select([c for c in columns if c in table.column_names and c != ROW_ERROR] + [ROW_ERROR])
    return table.append_column(ROW_INDEX, pa.array(range(row_start, row_start + table.num_rows), pa.int64()))


def _info(file_url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """A file's info now (size, modification stamps), so a changed file is parsed again."""
    fs, path = url_to_fs(file_url, **storage_options)
    fs.invalidate_cache()
    try:
        return retry(f"inspect {file_url}", lambda: fs.info(path))
    except FileNotFoundError:
        raise InputError(gone_message(file_url)) from None
    except (OSError, StorageError) as exc:
        raise InputError(f"input file {file_url}: cannot read: {exc}") from None


@functools.lru_cache(maxsize=2)
def _parsed_file(file_url: str, options_json: str, fmt: str, version: str) -> tuple[pa.Table, str]:
    """A whole text file as a table and its digest (the pin's), kept while a worker takes its shards one
    after another (a shard is a row range of it: parsing once per worker, not once per shard; one parse also
    keeps column types equal across the file's parts)."""
    fs, path = url_to_fs(file_url, **json.loads(options_json))
    data = _read_bytes(fs, path, file_url)
    return _parse(data, fmt, file_url), hashlib.sha1(data).hexdigest()[:20]


def _read_bytes(fs: Any, path: str, url: str) -> bytes:
    try:
        return retry(f"read {url}", lambda: fs.cat_file(path))
    except FileNotFoundError:
        raise InputError(gone_message(url)) from None
    except (OSError, StorageError) as exc:
        raise InputError(f"input file {url}: cannot read: {exc}") from None


def _parse(data: bytes, fmt: str, url: str) -> pa.Table:
    """A text file as a table: the columnar fast path when the whole file reads cleanly, else line by line
    (io/text_lines.py: a bad line is that row's error, in column ROW_ERROR)."""
    if fmt == "openai_batch":
        return openai_by_line(data)
    fast = _csv_fast(data) if fmt == "csv" else _jsonl_fast(data)
    if fast is not None:
        return fast
    log.info("input file %s: not clean for the columnar reader; reading it line by line", redact_text(url))
    try:
        return csv_by_line(data) if fmt == "csv" else jsonl_by_line(data)
    except (ValueError, csv.Error) as exc:
        raise InputError(f"input file {url}: not a readable {fmt.upper()} file ({exc})") from None


def _jsonl_fast(data: bytes) -> pa.Table | None:
    """pyarrow's JSON reader, or None when the file needs the per-line path (or its types would differ
    from JSON's: pyarrow reads date-like strings as timestamps)."""
    try:
        table = pajson.read_json(io.BytesIO(data))
        table.validate(full=True)  # the reader does not check UTF-8
    except (pa.ArrowInvalid, pa.ArrowTypeError, UnicodeDecodeError):
        return None
    return None if any(_is_temporal(f.type) for f in table.schema) else table


def _is_temporal(t: pa.DataType) -> bool:
    """Whether a type is or holds a date / time type (nested in lists and structs too)."""
    if pa.types.is_temporal(t):
        return True
    return any(_is_temporal(t.field(i).type) for i in range(t.num_fields))


def _csv_fast(data: bytes) -> pa.Table | None:
    """pyarrow's CSV reader, or None when a record does not read strictly (io/csv_records.py: pyarrow lets an
    unclosed quote swallow the rest of the file), the reader sees another number of records, or a record holds
    bytes that are not UTF-8 (the reader would make that column binary)."""
    shape = csv_shape(data)
    if shape is None:
        return None
    num_records, multiline = shape
    try:
        table = pacsv.read_csv(io.BytesIO(data), parse_options=pacsv.ParseOptions(newlines_in_values=multiline))
    except (pa.ArrowInvalid, UnicodeDecodeError):
        return None
    if table.num_rows != num_records:
        return None
    return None if any(pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type) for f in table.schema) \
        else table


def find_input_duplicates(files: list[InputFile], storage_options: dict[str, Any], fmt: str, column: str,
                          limit: int = 10) -> list[Duplicate]:
    """The first `limit` ids of `column` seen twice across the files (io/ids.py: bounded memory, hashes
    confirmed as text), the earliest repeat first. A null id counts as the id its row gets in the output,
    `<file-stem>:<row>`, so a real id equal to it is a duplicate too (`Duplicate.derived` says which side)."""
    parquet, text = ParquetIds(storage_options, column), _TextIds(storage_options, fmt, column)

    def raw(f: InputFile) -> IdSource:
        return parquet if file_format(f.url, fmt) == "parquet" else text

    try:
        found = find_duplicate_ids(files, lambda f: NullsDerived(raw(f)), limit)
        return [_with_derived(d, files, raw) for d in found]
    except (OSError, StorageError, pa.ArrowInvalid) as exc:
        raise InputError(f"input: cannot read the id column {column!r} to check that ids are unique: {exc}") from None


def _with_derived(dup: Duplicate, files: list[InputFile], raw: Any) -> Duplicate:
    """The duplicate, saying which of its two rows has a null id (its id derived)."""
    def is_null(at: tuple[int, int]) -> bool:
        f = files[at[0]]
        return raw(f).values(f, [at[1]]).get(at[1]) is None

    return dataclasses.replace(dup, derived=(is_null(dup.first), is_null(dup.again)))


class _TextIds:
    """The id column of a text file (parsed once per process, io/text_input.py's cache)."""

    def __init__(self, storage_options: dict[str, Any], fmt: str, column: str) -> None:
        self.storage_options, self.fmt, self.column = storage_options, fmt, column

    def _ids(self, f: InputFile) -> pa.ChunkedArray:
        table = read_input_rows(f.url, self.storage_options, self.fmt, 0, f.num_rows, [self.column])
        if self.column in table.column_names:
            return table.column(self.column)
        return pa.chunked_array([pa.nulls(table.num_rows, pa.string())])

    def scan(self, f: InputFile) -> Iterator[tuple[int, pa.Array]]:
        ids = self._ids(f)
        for start in range(0, len(ids), BATCH_ROWS):
            yield start, ids.slice(start, BATCH_ROWS)

    def values(self, f: InputFile, rows: list[int]) -> dict[int, Any]:
        ids = self._ids(f)
        return {row: ids[row].as_py() for row in rows}


def row_location(f: InputFile, row: int, storage_options: dict[str, Any], fmt: str) -> str:
    """Where a row is, for messages: `<url> row N` for Parquet (from 0, as in derived ids), `<url> line N`
    for a text file (from 1, blank lines counted, as an editor shows it)."""
    fmt = file_format(f.url, fmt)
    if fmt == "parquet":
        return f"{f.url} row {row}"
    fs, path = url_to_fs(f.url, **storage_options)
    lines = row_line_numbers(_read_bytes(fs, path, f.url), fmt)
    return f"{f.url} line {lines[row]}" if row < len(lines) else f"{f.url} row {row}"
