"""The planned row order of prefix-grouped files: written, uploaded, sliced, and rows read by it."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jobrunner.io import row_order
from jobrunner.io.decode import positions_of
from jobrunner.io.reader import ROW_INDEX
from jobrunner.io.row_order import RowOrderWriter, read_positions, read_rows_at, upload_row_order
from jobrunner.io.storage import Storage


def test_order_is_written_truncated_uploaded_once_and_sliced(tmp_path):
    writer = RowOrderWriter(str(tmp_path / "rows.bin"))
    writer.append(np.array([3, 1, 2, 0]))
    writer.append(np.array([9, 9]))
    writer.truncate(4)  # the second file's order was not kept
    writer.append(np.array([5, 4]))
    key = writer.finish()
    storage = Storage(str(tmp_path / "out"))
    upload_row_order(storage, writer.local_path, key)
    stored = tmp_path / "out" / key
    mtime = stored.stat().st_mtime_ns
    upload_row_order(storage, writer.local_path, key)  # already there: not written again
    assert stored.stat().st_mtime_ns == mtime
    assert read_positions(storage, key, 1, 5).tolist() == [1, 2, 0, 5]
    again = RowOrderWriter(str(tmp_path / "again.bin"))
    again.append(np.array([3, 1, 2, 0, 5, 4]))
    assert again.finish() == key  # the name is the content's digest


def test_rows_are_read_by_number_from_parquet_and_jsonl(tmp_path, monkeypatch):
    monkeypatch.setattr(row_order, "READ_GAP_ROWS", 2)  # several range reads
    ids = [f"r{i}" for i in range(20)]
    pq.write_table(pa.table({"id": ids, "prompt": [f"p{i}" for i in range(20)]}), tmp_path / "in.parquet",
                   row_group_size=4)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": i, "prompt": f"p{i}"}) + "\n" for i in ids))
    wanted = np.array([17, 2, 3, 11, 0])
    for name in ("in.parquet", "in.jsonl"):
        table = read_rows_at(str(tmp_path / name), {}, "auto", wanted, ["id", "prompt"])
        assert table.column(ROW_INDEX).to_pylist() == [0, 2, 3, 11, 17]
        assert table.column("id").to_pylist() == ["r0", "r2", "r3", "r11", "r17"]
        assert positions_of(table, [11, 0]) == [3, 0]
