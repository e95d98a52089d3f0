"""The per-line path for text input files: one bad line is that row's error, never the file's.

JSONL and CSV files are first read by pyarrow's columnar readers (io/text_input.py); only a file that fails
there (a value of another type than the rest of its column, bytes that are not UTF-8, a line that is not a
JSON object, a CSV record with the wrong number of fields) comes here. Every line becomes one row; a line
that cannot be read keeps what could be read, its bad values become null, and the column ROW_ERROR says
why, naming the line (numbered from 1, blank lines counted). OpenAI batch files always come here: each line
is one request, and a request that cannot be read keeps its `custom_id` when the text shows one.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from jobrunner.io.csv_records import csv_records
from jobrunner.io.reader import ROW_ERROR

# The columns an OpenAI batch file becomes (ROW_ERROR: why a line is not a request, else null).
OPENAI_COLUMNS = ("custom_id", "method", "url", "body", ROW_ERROR)
_FIELD = r'{}\s*:\s*("(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?)'  # a field's string or number value in a line's text
_CUSTOM_ID = re.compile(_FIELD.format('"custom_id"'))


def numbered_lines(data: bytes) -> list[tuple[int, bytes]]:
    """(line number from 1, raw bytes without the line end) of every non-blank line. Lines end at `\\n` only
    (a JSON string may hold U+2028, which `str.splitlines` would wrongly split on)."""
    lines = data.split(b"\n")
    return [(i, line.rstrip(b"\r")) for i, line in enumerate(lines, 1) if line.strip()]


def decode_line(raw: bytes, number: int) -> tuple[str, str | None]:
    """A line's text and None, or its text with bad bytes replaced and the error naming the line."""
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        text = raw.decode("utf-8", errors="replace")
        return text, f"line {number} is not valid UTF-8 ({exc.reason} at byte {exc.start})"


def json_object(raw: bytes, number: int) -> tuple[dict[str, Any], str | None, str]:
    """(the line's JSON object or {}, the error naming the line or None, the line's text). A line with bytes
    that are not UTF-8 keeps the fields that hold none of them (its id, say)."""
    text, error = decode_line(raw, number)
    try:
        record = json.loads(text)
    except ValueError as exc:
        return {}, error or f"line {number} is not valid JSON ({exc})", text
    if not isinstance(record, dict):
        return {}, error or f"line {number} is not a JSON object", text
    if error:
        bad = [k for k, v in record.items() if "\ufffd" in json.dumps(v, ensure_ascii=False)]
        record = {k: v for k, v in record.items() if k not in bad}
        if bad:
            error = f"line {number}: field {', '.join(map(repr, bad))} is not valid UTF-8" + error.split(" UTF-8", 1)[1]
    return record, error, text


def row_line_numbers(data: bytes, fmt: str) -> list[int]:
    """The line (from 1) each row of a text file starts on: rows skip blank lines, and a CSV row follows
    its header and may span several lines (io/csv_records.py: a bad record is a row on its first line)."""
    if fmt != "csv":
        return [number for number, _ in numbered_lines(data)]
    return [r.line for r in csv_records(data.decode("utf-8", errors="surrogateescape"))][1:]


# ---- JSONL -------------------------------------------------------------------------------------------------
def jsonl_by_line(data: bytes) -> pa.Table:
    """A JSONL file line by line: one row per non-blank line, bad lines and bad values as row errors. A line
    that is not a JSON object keeps the values its text shows for the other lines' fields holding a string
    or a number (its id, say), each when it appears exactly once."""
    numbers, records, errors, unread = [], [], [], {}
    for number, raw in numbered_lines(data):
        record, error, text = json_object(raw, number)
        if not record and error:
            unread[len(records)] = text
        numbers.append(number)
        records.append(record)
        errors.append(error)
    _salvage(records, unread)
    columns: dict[str, pa.Array] = {}
    for name in dict.fromkeys(k for r in records for k in r):
        array, bad = typed_column([r.get(name) for r in records])
        for position, what in bad.items():
            errors[position] = errors[position] or f"line {numbers[position]}: field {name!r} {what}"
        columns[name] = array
    columns[ROW_ERROR] = pa.array(errors, pa.string())
    return pa.table(columns)


def _salvage(records: list[dict[str, Any]], unread: dict[int, str]) -> None:
    """Fill the unreadable lines' records with the scalar fields their text shows (see jsonl_by_line)."""
    names = [name for name in dict.fromkeys(k for r in records for k in r)
             if any(isinstance(r.get(name), (str, int, float)) for r in records)]
    for position, text in unread.items():
        for name in names:
            value = _readable_field(text, name)
            if value is not None:
                records[position][name] = value


def typed_column(values: list[Any]) -> tuple[pa.Array, dict[int, str]]:
    """The values as one Arrow array, and position -> why for values left out (null) because their type is
    not the column's: the kind (object, list, string, number, boolean) most values have wins."""
    try:
        return pa.array(values), {}
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        pass
    kinds = [_kind(v) for v in values]
    majority = Counter(k for k in kinds if k).most_common(1)[0][0]
    bad = {i: f"is {_a(k)} where most lines have {_a(majority)}" for i, k in enumerate(kinds)
           if k and k != majority}
    kept = [None if i in bad else v for i, v in enumerate(values)]
    try:
        return pa.array(kept), bad
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        return _by_exact_type(kept, bad)


def _by_exact_type(values: list[Any], bad: dict[int, str]) -> tuple[pa.Array, dict[int, str]]:
    """Last resort for nested values whose shapes clash: the exact Arrow type most values have wins."""
    types: dict[int, pa.DataType | None] = {}
    for i, v in enumerate(values):
        if v is not None:
            try:
                types[i] = pa.array([v]).type
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
                types[i] = None
    common = Counter(t for t in types.values() if t is not None).most_common(1)
    target = common[0][0] if common else pa.null()
    for i, t in types.items():
        if t != target:
            bad[i] = "does not fit in one Arrow type" if t is None else f"has type {t} where most lines have {target}"
    return pa.array([None if i in bad else v for i, v in enumerate(values)], target), bad


def _kind(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {dict: "object", list: "list", str: "string"}.get(type(value), type(value).__name__)


def _a(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


# ---- CSV ---------------------------------------------------------------------------------------------------
def csv_by_line(data: bytes) -> pa.Table:
    """A CSV file record by record, read strictly (io/csv_records.py): a record with bad quoting, bad bytes or
    the wrong number of fields is a row error naming its first line (a bad quote keeps the cells before it and
    swallows no later line); the clean records are typed by pyarrow's CSV reader as usual."""
    text = data.decode("utf-8", errors="surrogateescape")  # bad bytes survive as lone surrogates
    records = csv_records(text)
    header_record = next(records, None)
    if header_record is None:
        return pa.table({ROW_ERROR: pa.array([], pa.string())})
    header = header_record.cells
    if header_record.error is not None:
        raise ValueError(f"the header: {header_record.error}")
    if _has_bad_bytes(header):
        raise ValueError("the header line is not valid UTF-8")
    rows, errors = [], []
    null_rows: dict[int, list[int]] = {}  # column -> rows whose cell is left out (null)
    for record in records:
        if record.error is not None:
            cells, bad = _kept_cells(record.cells, len(header))
            error = record.error
        else:
            cells, error, bad = _clean_record(record.cells, header, record.line)
        for column in bad:
            null_rows.setdefault(column, []).append(len(rows))
        rows.append(cells)
        errors.append(error)
    table = _with_nulls(_typed_csv(header, rows), null_rows)
    return table.append_column(ROW_ERROR, pa.array(errors, pa.string()))


def _kept_cells(cells: list[str], width: int) -> tuple[list[str], list[int]]:
    """A bad record's trusted cells padded to the header's width, and the columns left out (null): those past
    the trusted cells and those with bad bytes."""
    kept = cells[:width] + [""] * (width - min(len(cells), width))
    bad = [i for i in range(width) if i >= len(cells) or _has_bad_bytes(kept[i])]
    return ["" if i in bad else c for i, c in enumerate(kept)], bad


def _clean_record(record: list[str], header: list[str], line: int) -> tuple[list[str], str | None, list[int]]:
    """The record's cells (bad ones emptied), its error, and the columns whose cell is bad."""
    if len(record) != len(header):
        error = f"line {line}: {len(record)} fields where the header has {len(header)}"
        return [""] * len(header), error, list(range(len(header)))
    bad = [i for i, cell in enumerate(record) if _has_bad_bytes(cell)]
    if bad:
        cells = ["" if i in bad else c for i, c in enumerate(record)]
        return cells, f"line {line}: column {', '.join(repr(header[i]) for i in bad)} is not valid UTF-8", bad
    return record, None, []


def _with_nulls(table: pa.Table, null_rows: dict[int, list[int]]) -> pa.Table:
    """The table with the given cells null (a bad record's id must not read as the id "")."""
    for column, rows in null_rows.items():
        mask = np.zeros(table.num_rows, dtype=bool)
        mask[rows] = True
        values = table.column(column)
        table = table.set_column(column, table.field(column), pc.if_else(mask, pa.nulls(1, values.type)[0], values))
    return table


def _has_bad_bytes(cell: Any) -> bool:
    if isinstance(cell, list):
        return any(_has_bad_bytes(c) for c in cell)
    try:
        cell.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _typed_csv(header: list[str], records: list[list[str]]) -> pa.Table:
    """The clean records typed as pyarrow's CSV reader types them; all strings when a column's values
    do not share one type."""
    out = io.StringIO(newline="")
    writer = csv.writer(out)
    writer.writerow(header)
    writer.writerows(records)
    data = out.getvalue().encode("utf-8")
    parse = pacsv.ParseOptions(newlines_in_values=True)
    try:
        return pacsv.read_csv(io.BytesIO(data), parse_options=parse)
    except pa.ArrowInvalid:
        convert = pacsv.ConvertOptions(column_types={name: pa.string() for name in header})
        return pacsv.read_csv(io.BytesIO(data), parse_options=parse, convert_options=convert)


# ---- OpenAI batch ------------------------------------------------------------------------------------------
def openai_by_line(data: bytes) -> pa.Table:
    """One row per request line; a line that is not a request keeps its text in `body`, its `custom_id`
    when the text shows one, and ROW_ERROR naming the line."""
    rows: dict[str, list[Any]] = {name: [] for name in OPENAI_COLUMNS}
    for number, raw in numbered_lines(data):
        record, error, text = json_object(raw, number)
        custom_id = record.get("custom_id") if record else _readable_field(text, "custom_id")
        rows["custom_id"].append(None if custom_id is None else str(custom_id))
        for key in ("method", "url"):
            value = record.get(key)
            rows[key].append(None if value is None else str(value))
        body = record.get("body", text if error else None)
        rows["body"].append(body if isinstance(body, str) or body is None else json.dumps(body))
        rows[ROW_ERROR].append(error)
    return pa.table({name: pa.array(values, pa.string()) for name, values in rows.items()})


def _readable_field(text: str, name: str) -> str | int | float | None:
    """The string or number value of field `name` a malformed line shows, when it shows exactly one."""
    pattern = _CUSTOM_ID if name == "custom_id" else re.compile(_FIELD.format(re.escape(json.dumps(name))))
    found = pattern.findall(text)
    if len(found) != 1:
        return None
    try:
        value = json.loads(found[0])
    except ValueError:
        return None
    if value is None or "\ufffd" in str(value):
        return None
    return str(value) if name == "custom_id" else value
