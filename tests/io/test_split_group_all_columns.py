"""A shard that splits a row group, read with every column (output.keep_columns '*', every pipeline stage)."""

import pyarrow as pa
import pyarrow.parquet as pq

from jobrunner.io.reader import read_rows


def test_pieces_of_one_row_group_read_with_all_columns(tmp_path):
    path = tmp_path / "one_group.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(8)], "n": list(range(8))}), path, row_group_size=8)
    first, second = (read_rows(str(path), {}, a, b, None) for a, b in ((0, 4), (4, 8)))
    assert first.column("id").to_pylist() == ["r0", "r1", "r2", "r3"] and second.column("n").to_pylist() == [4, 5, 6, 7]
    assert {"id", "n"} <= set(first.column_names)
