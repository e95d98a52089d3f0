"""io: storage (atomic writes, listing), reading the input, writing parts, on memory://, file:// and S3."""

from __future__ import annotations

import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobrunner.io.layout import TEMP_DIR, part_key
from jobrunner.io.manifest import read_manifest, read_manifest_table, write_manifest
from jobrunner.io.parts import OUTPUT_SCHEMA, read_output, rows_to_table, write_part
from jobrunner.io.reader import (
    ROW_INDEX,
    InputError,
    check_columns,
    list_input_files,
    parse_messages,
    parse_overrides,
    read_rows,
)
from jobrunner.io.shard_file import from_entries
from jobrunner.io.storage import Storage


def _prompts_table(n: int, start: int = 0) -> pa.Table:
    return pa.table({"id": [f"r{i}" for i in range(start, start + n)],
                     "prompt": [f"prompt number {i}" for i in range(start, start + n)],
                     "n": list(range(start, start + n))})


def _write(fs_url: str, table: pa.Table, storage_options=None, row_group_size: int = 4) -> None:
    import fsspec

    with fsspec.open(fs_url, "wb", **(storage_options or {})) as f:
        pq.write_table(table, f, row_group_size=row_group_size)


def _out_row(i: int) -> dict:
    return {"id": f"r{i}", ROW_INDEX: i, "generated_text": "x", "finish_reason": "length", "error": None,
            "num_prompt_tokens": 3, "num_cached_tokens": 0, "num_output_tokens": 1, "shard_id": "s",
            "worker_id": "w0", "finish_time_s": 1.0}


@pytest.mark.parametrize("base", ["memory://io-test", "file"])
def test_input_listing_and_row_ranges(base, tmp_path):
    root = f"{base}-{uuid.uuid4().hex[:6]}" if base.startswith("memory") else str(tmp_path)
    _write(f"{root}/data/a.parquet", _prompts_table(10))
    _write(f"{root}/data/b.parquet", _prompts_table(6, start=10))
    _write(f"{root}/data/_ignored.parquet", _prompts_table(3))
    _write(f"{root}/data/_temporary/x/part.parquet", _prompts_table(3))
    files = list_input_files(f"{root}/data", {})
    got = [(f.stem, f.num_rows, f.row_group_num_rows) for f in files]
    assert got == [("a", 10, (4, 4, 2)), ("b", 6, (4, 2))]
    assert [f.stem for f in list_input_files(f"{root}/data/b*.parquet", {})] == ["b"]
    assert [f.stem for f in list_input_files(f"{root}/data/a.parquet", {})] == ["a"]
    table = read_rows(files[0].url, {}, 3, 9, ["id"])
    assert table.column("id").to_pylist() == [f"r{i}" for i in range(3, 9)]
    assert table.column(ROW_INDEX).to_pylist() == list(range(3, 9))


def test_input_errors_name_the_problem(tmp_path):
    with pytest.raises(InputError, match="not found"):
        list_input_files(str(tmp_path / "missing.parquet"), {})
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no Parquet files"):
        list_input_files(str(tmp_path / "empty"), {})
    (tmp_path / "bad.parquet").write_bytes(b"this is not parquet at all")
    with pytest.raises(InputError, match=r"bad\.parquet: not a readable Parquet file"):
        list_input_files(str(tmp_path / "bad.parquet"), {})
    _write(str(tmp_path / "ok.parquet"), _prompts_table(3))
    files = list_input_files(str(tmp_path / "ok.parquet"), {})
    with pytest.raises(InputError, match=r"ok\.parquet: missing column 'text' \(input.prompt_column\)"):
        check_columns(files, {"prompt_column": "text"}, [])
    with pytest.raises(InputError, match=r"column 'n' \(input.prompt_column\) has type int64"):
        check_columns(files, {"prompt_column": "n"}, [])
    with pytest.raises(InputError, match=r"missing column 'extra' \(output.keep_columns\)"):
        check_columns(files, {"prompt_column": "prompt"}, ["extra"])
    check_columns(files, {"prompt_column": "prompt", "id_column": "n"}, ["id"])


def test_cell_parsers():
    assert parse_messages('[{"role": "user", "content": "hi"}]') == [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError):
        parse_messages([{"role": "user"}])
    assert parse_overrides('{"max_tokens": 3, "top_k": null}') == {"max_tokens": 3}
    assert parse_overrides([("max_tokens", 3)]) == {"max_tokens": 3}
    assert parse_overrides(None) == {}
    with pytest.raises(ValueError):
        parse_overrides("[1, 2]")


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_parts_commit_and_overwrite(kind, tmp_path):
    url = f"memory://parts-{uuid.uuid4().hex[:6]}" if kind == "memory" else str(tmp_path / "out")
    storage = Storage(url)
    kept = pa.table({"n": [10, 11, 12], ROW_INDEX: pa.array([0, 1, 2], pa.int64())})
    rows = [_out_row(2), _out_row(0)]  # finished out of order
    key = write_part(storage, "s1", rows_to_table(rows, kept))
    assert key == part_key("s1")
    write_part(storage, "s1", rows_to_table(rows, kept))  # a retried shard replaces its part
    out = read_output(url)
    assert out.num_rows == 2
    assert out.column("id").to_pylist() == ["r2", "r0"]
    assert out.column("n").to_pylist() == [12, 10]
    assert out.schema.names[: len(OUTPUT_SCHEMA)] == OUTPUT_SCHEMA.names
    assert storage.listdir(TEMP_DIR) in ([], [f"{TEMP_DIR}"]) or all(
        not storage.listdir(d) for d in storage.listdir(TEMP_DIR))


def test_manifest_roundtrip_memory():
    storage = Storage(f"memory://manifest-{uuid.uuid4().hex[:6]}")
    assert read_manifest(storage) is None
    write_manifest(storage, {"a": 1}, from_entries({}))
    write_manifest(storage, {"a": 2}, from_entries({}))
    assert read_manifest(storage)["a"] == 2 and read_manifest_table(storage)[1].shard_id.size == 0


def make_bucket(s3_server) -> str:
    """A fresh bucket on the test S3 server."""
    import boto3

    bucket = f"t-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_server["endpoint_url"], aws_access_key_id="testing",
                 aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=bucket)
    return bucket


def test_s3_input_and_output(s3_server):
    opts = s3_server["storage_options"]
    bucket = make_bucket(s3_server)
    _write(f"s3://{bucket}/in/p.parquet", _prompts_table(5), opts)
    files = list_input_files(f"s3://{bucket}/in/", opts)
    assert files[0].url == f"s3://{bucket}/in/p.parquet" and files[0].num_rows == 5
    assert read_rows(files[0].url, opts, 1, 3, ["prompt"]).num_rows == 2
    storage = Storage(f"s3://{bucket}/out", opts)
    write_part(storage, "s0", rows_to_table([_out_row(0)]))
    write_manifest(storage, {"ok": True}, from_entries({}))
    assert read_output(f"s3://{bucket}/out", opts).column("id").to_pylist() == ["r0"]
    assert read_manifest(storage)["ok"] is True
    assert storage.listdir("parts") == ["parts/part-s0.parquet"]


def test_s3_unreachable_bucket_is_named(s3_server):
    opts = s3_server["storage_options"]
    with pytest.raises(InputError, match="no-such-bucket-xyz"):
        list_input_files("s3://no-such-bucket-xyz/data/", opts)
