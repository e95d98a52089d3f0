"""Planning reads each input byte once: shards follow row groups, a big row group is fetched once per worker
(not once per shard), footers once per worker, only the asked-for column chunks; exact byte counts."""

from __future__ import annotations

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobrunner.driver.plan import plan_job
from jobrunner.io.reader import list_input_files, read_rows
from jobrunner.io.row_groups import FOOTER_TRAILER, ReadStats, RowGroupCache
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import new_bucket

GROUPS = (300, 300, 300, 2500, 100)
COLUMNS = ["id", "prompt"]


def _write(url: str, storage_options: dict) -> None:
    """One file with row groups of GROUPS rows; `filler` is a column no shard asks for."""
    start = 0
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("filler", pa.string())])
    with fsspec.open(url, "wb", **storage_options) as f, pq.ParquetWriter(f, schema) as writer:
        for n in GROUPS:
            rows = range(start, start + n)
            writer.write_table(pa.table({"id": [f"r{i}" for i in rows], "prompt": [f"say {i}" for i in rows],
                                         "filler": ["x" * 50 + str(i) for i in rows]}, schema=schema),
                               row_group_size=n)
            start += n


def _chunk_bytes(meta: pq.FileMetaData, group: int) -> int:
    names = [meta.schema.column(j).name for j in range(meta.num_columns)]
    return sum(meta.row_group(group).column(names.index(c)).total_compressed_size for c in COLUMNS)


def _read_all(shards, storage_options: dict, num_workers: int) -> tuple[ReadStats, list[str]]:
    """Read every shard as `num_workers` workers would (shards dealt out in turn, one cache each)."""
    stats, caches, ids = ReadStats(), [RowGroupCache() for _ in range(num_workers)], []
    for i, shard in enumerate(shards):
        table = read_rows(shard.file_url, storage_options, shard.row_start, shard.row_end, COLUMNS, stats,
                          caches[i % num_workers])
        ids += table.column("id").to_pylist()
    return stats, ids


@pytest.mark.parametrize("where", ["local", "s3"])
def test_shards_follow_row_groups_and_each_byte_is_read_once(where, tmp_path, request):
    if where == "s3":
        s3 = request.getfixturevalue("s3_server")
        options, url = s3["storage_options"], f"s3://{new_bucket(s3)}/in/data.parquet"
    else:
        options, url = {}, str(tmp_path / "data.parquet")
    _write(url, options)
    spec = spec_from_dict({"name": "p", "input": {"url": url, "prompt_column": "prompt", "id_column": "id",
                                                  "rows_per_shard": 700, "storage_options": options},
                           "output": {"url": str(tmp_path / "out")}})
    plan = plan_job(spec)
    assert [(s.row_start, s.row_end) for s in plan.shards] == [
        (0, 600), (600, 900), (900, 1525), (1525, 2150), (2150, 2775), (2775, 3400), (3400, 3500)]

    (info,) = list_input_files(url, options)
    with fsspec.open(url, "rb", **options) as f:
        meta = pq.ParquetFile(f).metadata
    assert info.row_group_num_rows == GROUPS and info.num_bytes == fsspec.filesystem(
        fsspec.core.split_protocol(url)[0] or "file", **options).size(url)
    footer = meta.serialized_size + FOOTER_TRAILER
    chunks = [_chunk_bytes(meta, g) for g in range(len(GROUPS))]

    one, ids = _read_all(plan.shards, options, num_workers=1)
    assert ids == [f"r{i}" for i in range(3500)]
    assert (one.footer_bytes, one.data_bytes) == (footer, sum(chunks))
    assert one.total_bytes / info.num_bytes == (footer + sum(chunks)) / info.num_bytes < 1.0

    # Two workers: each reads the footer and the split 2,500-row group once; the aligned groups once in all.
    two, ids = _read_all(plan.shards, options, num_workers=2)
    assert sorted(ids) == sorted(f"r{i}" for i in range(3500))
    assert (two.footer_bytes, two.data_bytes) == (2 * footer, sum(chunks) + chunks[3])


def test_a_rewritten_file_is_not_served_from_the_cache(tmp_path):
    url, cache = str(tmp_path / "data.parquet"), RowGroupCache()
    pq.write_table(pa.table({"id": ["a", "b", "c", "d"]}), url, row_group_size=4)
    assert read_rows(url, {}, 0, 2, ["id"], cache=cache).column("id").to_pylist() == ["a", "b"]
    pq.write_table(pa.table({"id": ["w", "x", "y", "z", "v"]}), url, row_group_size=5)
    assert read_rows(url, {}, 0, 2, ["id"], cache=cache).column("id").to_pylist() == ["w", "x"]
