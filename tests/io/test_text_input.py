"""JSONL, CSV and OpenAI-batch input files: listing, row counts, column types, row ranges, errors."""

from __future__ import annotations

import json

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobrunner.io.reader import ROW_INDEX, InputError
from jobrunner.io.text_input import file_format, list_input, read_input_rows

JSONL = (
    '{"id": "a", "messages": [{"role": "user", "content": "hi"}], "params": {"n": 2}}\n'
    "\n"
    '{"id": "b", "messages": [{"role": "user", "content": "yo"}], "extra": 3}\n'
    '{"id": "c", "messages": [{"role": "user", "content": "hey"}]}\n'
)


def test_format_by_extension():
    assert [file_format(p, "auto") for p in ("a.jsonl", "a.ndjson", "a.json", "a.csv", "a.parquet", "a")] == [
        "jsonl", "jsonl", "jsonl", "csv", "parquet", "parquet"]
    assert file_format("a.jsonl", "openai_batch") == "openai_batch"


def test_jsonl_rows_columns_and_ranges(tmp_path):
    (tmp_path / "d.jsonl").write_text(JSONL)
    [f] = list_input(str(tmp_path / "d.jsonl"), {}, "auto")
    assert f.stem == "d" and f.num_rows == 3 and f.row_group_num_rows == (3,)
    assert f.column_types["id"] == "string" and f.column_types["extra"] == "int64"
    assert f.column_types["messages"].startswith("list<item: struct<")
    table = read_input_rows(f.url, {}, "auto", 1, 3, ["id", "extra"])
    assert table.column_names == ["id", "extra", ROW_INDEX]
    assert table.to_pylist() == [{"id": "b", "extra": 3, ROW_INDEX: 1}, {"id": "c", "extra": None, ROW_INDEX: 2}]
    assert read_input_rows(f.url, {}, "jsonl", 0, 1, None).column("params").to_pylist() == [{"n": 2}]


def test_csv_rows(tmp_path):
    (tmp_path / "p.csv").write_text('id,prompt,topic\n1,"Hello, there",x\n2,"two\nlines",y\n')
    [f] = list_input(str(tmp_path), {}, "auto")
    assert f.num_rows == 2 and f.column_types == {"id": "int64", "prompt": "string", "topic": "string"}
    assert read_input_rows(f.url, {}, "csv", 1, 2, ["prompt"]).to_pylist() == [
        {"prompt": "two\nlines", ROW_INDEX: 1}]


def test_auto_lists_every_known_format_and_skips_others(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"prompt": "x"}\n')
    (tmp_path / "b.csv").write_text("prompt\ny\n")
    pq.write_table(pa.table({"prompt": ["z"]}), tmp_path / "c.parquet")
    (tmp_path / "notes.txt").write_text("not input")
    (tmp_path / "_hidden.jsonl").write_text("not json")
    files = list_input(str(tmp_path), {}, "auto")
    assert [f.stem for f in files] == ["a", "b", "c"]
    assert [read_input_rows(f.url, {}, "auto", 0, 1, ["prompt"]).column("prompt")[0].as_py() for f in files] == [
        "x", "y", "z"]
    assert [f.stem for f in list_input(str(tmp_path), {}, "csv")] == ["b"]


def test_bad_jsonl_line_names_file_and_line(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "x"}\n{"prompt": \n')
    with pytest.raises(InputError, match=r"d\.jsonl: line 2 is not valid JSON"):
        list_input(str(tmp_path / "d.jsonl"), {}, "auto")
    (tmp_path / "d.jsonl").write_text('{"prompt": "x"}\n[1, 2]\n')
    with pytest.raises(InputError, match=r"line 2 is not a JSON object"):
        list_input(str(tmp_path / "d.jsonl"), {}, "auto")
    (tmp_path / "d.jsonl").write_text('{"prompt": "x"}\n{"prompt": 5}\n')
    with pytest.raises(InputError, match=r"field 'prompt' has values of mixed types"):
        list_input(str(tmp_path / "d.jsonl"), {}, "auto")
    with pytest.raises(InputError, match=r"no csv files found"):
        list_input(str(tmp_path), {}, "csv")


def test_openai_batch_lines_become_rows_and_bad_lines_row_errors(tmp_path):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    lines = [json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": body}),
             "{not json", "[1]", json.dumps({"custom_id": 7, "url": "/v1/completions", "body": {"prompt": "x"}})]
    (tmp_path / "batch.jsonl").write_text("\n".join(lines) + "\n")
    [f] = list_input(str(tmp_path / "batch.jsonl"), {}, "openai_batch")
    assert f.num_rows == 4 and set(f.column_types) == {"custom_id", "method", "url", "body", "_error"}
    rows = read_input_rows(f.url, {}, "openai_batch", 0, 4, None).to_pylist()
    assert rows[0]["custom_id"] == "r1" and json.loads(rows[0]["body"]) == body and rows[0]["_error"] is None
    assert rows[1]["custom_id"] is None and rows[1]["_error"].startswith("line 2 is not valid JSON")
    assert rows[2]["_error"] == "line 3 is not a JSON object"
    assert rows[3]["custom_id"] == "7" and rows[3]["method"] is None and rows[3][ROW_INDEX] == 3


def test_jsonl_on_s3(s3_server, tmp_path):
    from tests.driver.helpers import new_bucket

    bucket = new_bucket(s3_server)
    opts = s3_server["storage_options"]
    with fsspec.open(f"s3://{bucket}/in/d.jsonl", "w", **opts) as fh:
        fh.write(JSONL)
    [f] = list_input(f"s3://{bucket}/in/", opts, "jsonl")
    assert f.url == f"s3://{bucket}/in/d.jsonl" and f.num_rows == 3
    assert read_input_rows(f.url, opts, "jsonl", 2, 3, ["id"]).to_pylist() == [{"id": "c", ROW_INDEX: 2}]


def test_a_rewritten_file_is_read_again(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "one"}\n')
    assert read_input_rows(str(path), {}, "auto", 0, 1, ["prompt"]).column("prompt").to_pylist() == ["one"]
    path.write_text('{"prompt": "two, longer"}\n')
    assert read_input_rows(str(path), {}, "auto", 0, 1, ["prompt"]).column("prompt").to_pylist() == ["two, longer"]
