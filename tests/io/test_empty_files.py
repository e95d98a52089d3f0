"""Empty input files as listing describes them: a 0-byte file of any format, a Parquet file with no rows and
no schema, and one with no rows but columns all come back with no rows (planning skips them), never as an
unreadable file."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from jobrunner.io.text_input import list_input


def test_empty_files_are_listed_with_no_rows(tmp_path):
    for name in ("a.jsonl", "b.parquet", "c.csv"):
        (tmp_path / name).write_bytes(b"")
    pq.write_table(pa.table({}), tmp_path / "d.parquet")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "e.parquet")
    files = list_input(str(tmp_path), {}, "auto")
    assert [(f.url.rsplit("/", 1)[1], f.num_rows, f.row_group_num_rows, f.column_types) for f in files] == [
        ("a.jsonl", 0, (), {}), ("b.parquet", 0, (), {}), ("c.csv", 0, (), {}), ("d.parquet", 0, (0,), {}),
        ("e.parquet", 0, (0,), {"prompt": "string"})]
    assert [f.num_bytes for f in files][:3] == [0, 0, 0] and all(f.stamps for f in files)
