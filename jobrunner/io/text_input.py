"""JSONL, CSV and OpenAI-batch input files, next to Parquet: listing, row counts, column types, row ranges.

`input.format` picks the reader; `auto` goes by each file's extension. A text file has no row groups, so the
planner sees it as one group of all its rows and a shard reads the file and keeps its row range. Lines are
parsed when the file is listed, so a JSONL line that is not a JSON object fails the job before any worker
starts, naming file and line. OpenAI batch lines are the exception: each line is one request, so a bad line
becomes that row's error (column `_error`), never the file's.
"""

from __future__ import annotations

import functools
import io
import json
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
from fsspec.core import url_to_fs

from jobrunner.io.reader import (
    PARQUET_SUFFIXES,
    ROW_INDEX,
    InputError,
    InputFile,
    _expand,
    _read_footer,
    add_duplicates,
    file_stem,
    map_files,
    read_rows,
)
from jobrunner.io.storage import StorageError, retry

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
CSV_SUFFIXES = (".csv",)
# The columns an OpenAI batch file becomes; `_error` says why a line is not a request (else null).
OPENAI_COLUMNS = ("custom_id", "method", "url", "body", "_error")
OPENAI_ERROR_COLUMN = "_error"


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
    table = _parse(_read_bytes(fs, path, url), fmt, url)
    return InputFile(url=url, stem=file_stem(path), num_rows=table.num_rows,
                     row_group_num_rows=(table.num_rows,) if table.num_rows else (),
                     column_types={f.name: str(f.type) for f in table.schema})


def read_input_rows(file_url: str, storage_options: dict[str, Any], fmt: str, row_start: int, row_end: int,
                    columns: list[str] | None) -> pa.Table:
    """Rows [row_start, row_end) of one input file of any format, `columns` (None: all) plus ROW_INDEX."""
    fmt = file_format(file_url, fmt)
    if fmt == "parquet":
        return read_rows(file_url, storage_options, row_start, row_end, columns)
    options = json.dumps(storage_options, sort_keys=True, default=str)
    table = _parsed_file(file_url, options, fmt, _version(file_url, storage_options))
    table = table.slice(row_start, row_end - row_start)
    if columns is not None:
        table = table.select([c for c in columns if c in table.column_names])
    return table.append_column(ROW_INDEX, pa.array(range(row_start, row_start + table.num_rows), pa.int64()))


def _version(file_url: str, storage_options: dict[str, Any]) -> str:
    """Size and modification stamp of a file, so a changed file is parsed again."""
    fs, path = url_to_fs(file_url, **storage_options)
    fs.invalidate_cache()
    try:
        info = retry(f"inspect {file_url}", lambda: fs.info(path))
    except (OSError, StorageError) as exc:
        raise InputError(f"input file {file_url}: cannot read: {exc}") from None
    stamp = info.get("mtime") or info.get("LastModified") or info.get("ETag") or info.get("updated")
    return f"{info.get('size')}|{stamp}"


@functools.lru_cache(maxsize=2)
def _parsed_file(file_url: str, options_json: str, fmt: str, version: str) -> pa.Table:
    """A whole text file as a table, kept while a worker takes its shards one after another (a shard is a row
    range of it: parsing once per worker, not once per shard; one parse also keeps column types equal
    across the file's parts)."""
    fs, path = url_to_fs(file_url, **json.loads(options_json))
    return _parse(_read_bytes(fs, path, file_url), fmt, file_url)


def _read_bytes(fs: Any, path: str, url: str) -> bytes:
    try:
        return retry(f"read {url}", lambda: fs.cat_file(path))
    except (OSError, StorageError) as exc:
        raise InputError(f"input file {url}: cannot read: {exc}") from None


def _parse(data: bytes, fmt: str, url: str) -> pa.Table:
    if fmt == "csv":
        return _parse_csv(data, url)
    if fmt == "openai_batch":
        return _parse_openai_batch(data, url)
    return _parse_jsonl(data, url)


def _parse_csv(data: bytes, url: str) -> pa.Table:
    try:
        return pacsv.read_csv(io.BytesIO(data))
    except (pa.ArrowInvalid, UnicodeDecodeError) as exc:
        raise InputError(f"input file {url}: not a readable CSV file ({exc})") from None


def _lines(data: bytes, url: str) -> list[tuple[int, str]]:
    """(line number from 1, text) of every non-blank line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"input file {url}: not UTF-8 text ({exc})") from None
    return [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]


def _parse_jsonl(data: bytes, url: str) -> pa.Table:
    records = []
    for number, line in _lines(data, url):
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise InputError(f"input file {url}: line {number} is not valid JSON ({exc})") from None
        if not isinstance(record, dict):
            raise InputError(f"input file {url}: line {number} is not a JSON object")
        records.append(record)
    names = list(dict.fromkeys(k for r in records for k in r))
    columns = {}
    for name in names:
        try:
            columns[name] = pa.array([r.get(name) for r in records])
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise InputError(f"input file {url}: field {name!r} has values of mixed types ({exc})") from None
    return pa.table(columns) if columns else pa.table({})


def _parse_openai_batch(data: bytes, url: str) -> pa.Table:
    """One row per line; a line that is not a request object keeps its text in `body` and an `_error`."""
    rows: dict[str, list[Any]] = {name: [] for name in OPENAI_COLUMNS}
    for number, line in _lines(data, url):
        record, error = _openai_record(line, number)
        rows["custom_id"].append(None if record.get("custom_id") is None else str(record["custom_id"]))
        for key in ("method", "url"):
            value = record.get(key)
            rows[key].append(None if value is None else str(value))
        body = record.get("body", line if error else None)
        rows["body"].append(body if isinstance(body, str) or body is None else json.dumps(body))
        rows["_error"].append(error)
    return pa.table({name: pa.array(values, pa.string()) for name, values in rows.items()})


def _openai_record(line: str, number: int) -> tuple[dict[str, Any], str | None]:
    try:
        record = json.loads(line)
    except ValueError as exc:
        return {}, f"line {number} is not valid JSON ({exc})"
    if not isinstance(record, dict):
        return {}, f"line {number} is not a JSON object"
    return record, None


def duplicate_input_ids(files: list[InputFile], storage_options: dict[str, Any], fmt: str, column: str,
                        limit: int = 10) -> list[str]:
    """Up to `limit` values of `column` that appear more than once across the files, for any input format."""
    seen: set[str] = set()
    dups: list[str] = []
    for f in files:
        table = read_input_rows(f.url, storage_options, fmt, 0, f.num_rows, [column])
        values = table.column(column).to_pylist() if column in table.column_names else []
        if add_duplicates(values, seen, dups, limit):
            return dups
    return dups
