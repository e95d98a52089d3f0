"""Arrow rows to Python rows, one undecodable row at a time: a cell whose bytes are not valid UTF-8 makes
that row an error (named by column), never the whole shard."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from jobrunner.io.reader import ROW_INDEX


def rows_or_errors(table: pa.Table) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """(rows that decode, row index -> error for rows that do not). Fast path: the whole table at once."""
    try:
        return table.to_pylist(), {}
    except UnicodeDecodeError:
        pass
    rows: list[dict[str, Any]] = []
    errors: dict[int, str] = {}
    indexes = table.column(ROW_INDEX).to_pylist()
    for position, row_index in enumerate(indexes):
        one = table.slice(position, 1)
        try:
            rows.append(one.to_pylist()[0])
        except UnicodeDecodeError as exc:
            errors[row_index] = f"{_bad_columns(one)}: not valid UTF-8 ({exc.reason} at byte {exc.start})"
    return rows, errors


def _bad_columns(one_row: pa.Table) -> str:
    bad = []
    for name in one_row.column_names:
        try:
            one_row.column(name).to_pylist()
        except UnicodeDecodeError:
            bad.append(repr(name))
    return f"column {', '.join(bad)}" if bad else "row"


def row_id_or_none(table: pa.Table, id_column: str | None, row_index: int) -> str | None:
    """The id of one row as text when it decodes, else None (the caller derives one)."""
    if id_column is None:
        return None
    position = positions_of(table, [row_index])[0]
    try:
        value = table.column(id_column)[position].as_py()
    except UnicodeDecodeError:
        return None
    return None if value is None else str(value)


def positions_of(table: pa.Table, row_indexes: list[int]) -> list[int]:
    """Where rows (by ROW_INDEX) are in a table read for a shard: its ROW_INDEX increases, by one for a row
    range, with gaps for the rows of a prefix-grouped shard (io/row_order.py)."""
    column = table.column(ROW_INDEX)
    if not table.num_rows:
        return list(row_indexes)
    first, last = column[0].as_py(), column[-1].as_py()
    if last - first + 1 == table.num_rows:  # a plain row range
        return [r - first for r in row_indexes]
    return np.searchsorted(column.to_numpy(), np.asarray(row_indexes, np.int64)).tolist()
