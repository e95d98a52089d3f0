"""JSONL, CSV and OpenAI-batch input files: listing, row counts, column types, row ranges, errors."""

from __future__ import annotations

import json

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobrunner.io import text_input
from jobrunner.io.reader import ROW_ERROR, ROW_INDEX, InputError
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
    assert table.column_names == ["id", "extra", ROW_ERROR, ROW_INDEX]
    assert table.to_pylist() == [{"id": "b", "extra": 3, ROW_ERROR: None, ROW_INDEX: 1},
                                 {"id": "c", "extra": None, ROW_ERROR: None, ROW_INDEX: 2}]
    # a clean file is read by pyarrow's columnar reader: no per-line error column at all
    assert ROW_ERROR not in text_input._parse(JSONL.encode(), "jsonl", "d.jsonl").column_names
    assert read_input_rows(f.url, {}, "jsonl", 0, 1, None).column("params").to_pylist() == [{"n": 2}]


def test_csv_rows(tmp_path):
    (tmp_path / "p.csv").write_text('id,prompt,topic\n1,"Hello, there",x\n2,"two\nlines",y\n')
    [f] = list_input(str(tmp_path), {}, "auto")
    assert f.num_rows == 2 and f.column_types == {"id": "int64", "prompt": "string", "topic": "string"}
    assert read_input_rows(f.url, {}, "csv", 1, 2, ["prompt"]).to_pylist() == [
        {"prompt": "two\nlines", ROW_ERROR: None, ROW_INDEX: 1}]


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


def test_bad_jsonl_lines_are_row_errors_naming_the_line(tmp_path):
    lines = [b'{"id": "a", "messages": [{"role": "user", "content": "hi"}]}', b"",
             b'{"id": "b", "messages": "not a list"}',
             b'{"id": "c", "messages": [{"role": "user", "content": "bad \xff byte"}]}',
             b"[1, 2]", b'{"id": "e", "messages": ', b'{"id": "f", "messages": [{"role": "user", "content": "ok"}]}']
    (tmp_path / "d.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    [f] = list_input(str(tmp_path / "d.jsonl"), {}, "auto")
    assert f.num_rows == 6 and f.column_types["messages"].startswith("list<") and ROW_ERROR not in f.column_types
    rows = read_input_rows(f.url, {}, "auto", 0, 6, ["id", "messages"]).to_pylist()
    assert [r["id"] for r in rows] == ["a", "b", "c", None, "e", "f"]  # a cut line keeps the id it shows
    errors = [r[ROW_ERROR] for r in rows]
    assert errors[0] is None and errors[5] is None
    assert errors[1] == "line 3: field 'messages' is a string where most lines have a list"
    assert errors[2].startswith("line 4: field 'messages' is not valid UTF-8 (invalid start byte at byte ")
    assert errors[3] == "line 5 is not a JSON object" and errors[4].startswith("line 6 is not valid JSON")
    assert rows[5]["messages"] == [{"role": "user", "content": "ok"}] and rows[1]["messages"] is None
    with pytest.raises(InputError, match=r"no csv files found"):
        list_input(str(tmp_path), {}, "csv")


def test_bad_csv_records_are_row_errors_naming_the_line(tmp_path):
    data = b'id,prompt,n\n1,hello,3\n2,"two\nlines \xff",4\n3,ok,5,extra\n\n4,fine,6\n'
    (tmp_path / "p.csv").write_bytes(data)
    [f] = list_input(str(tmp_path / "p.csv"), {}, "auto")
    assert f.num_rows == 4 and f.column_types == {"id": "int64", "prompt": "string", "n": "int64"}
    rows = read_input_rows(f.url, {}, "auto", 0, 4, None).to_pylist()
    assert [(r["id"], r["prompt"], r["n"]) for r in rows] == [(1, "hello", 3), (2, None, 4), (None, None, None),
                                                          (4, "fine", 6)]
    assert [r[ROW_ERROR] for r in rows] == [None, "line 3: column 'prompt' is not valid UTF-8",
                                            "line 5: 4 fields where the header has 3", None]
    # an id column whose one bad cell is not UTF-8: that row's error; the others keep their integer ids
    (tmp_path / "p.csv").write_bytes(b"id,prompt\n" + b"".join(b"%d,p\n" % i for i in range(3)) + b"x\xff,q\n")
    [f] = list_input(str(tmp_path / "p.csv"), {}, "auto")
    assert read_input_rows(f.url, {}, "csv", 2, 4, ["id"]).to_pylist() == [
        {"id": 2, ROW_ERROR: None, ROW_INDEX: 2},
        {"id": None, ROW_ERROR: "line 5: column 'id' is not valid UTF-8", ROW_INDEX: 3}]


def test_openai_batch_lines_become_rows_and_bad_lines_row_errors(tmp_path):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    lines = [json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": body}),
             '{"custom_id": "r2", "body": {"messages": ', "[1]",
             json.dumps({"custom_id": 7, "url": "/v1/completions", "body": {"prompt": "x"}}), "{no id at all"]
    data = ("\n".join(lines) + "\n").encode() + b'{"custom_id": "r6", "body": "\xff"}\n'
    (tmp_path / "batch.jsonl").write_bytes(data)
    [f] = list_input(str(tmp_path / "batch.jsonl"), {}, "openai_batch")
    assert f.num_rows == 6 and set(f.column_types) == {"custom_id", "method", "url", "body"}
    rows = read_input_rows(f.url, {}, "openai_batch", 0, 6, None).to_pylist()
    assert rows[0]["custom_id"] == "r1" and json.loads(rows[0]["body"]) == body and rows[0][ROW_ERROR] is None
    # a malformed line keeps the custom_id it shows, and its error names the line
    assert rows[1]["custom_id"] == "r2" and rows[1][ROW_ERROR].startswith("line 2 is not valid JSON")
    assert rows[2]["custom_id"] is None and rows[2][ROW_ERROR] == "line 3 is not a JSON object"
    assert rows[3]["custom_id"] == "7" and rows[3]["method"] is None and rows[3][ROW_INDEX] == 3
    assert rows[4]["custom_id"] is None and rows[4][ROW_ERROR].startswith("line 5 is not valid JSON")
    assert rows[5]["custom_id"] == "r6" and rows[5][ROW_ERROR].startswith("line 6: field 'body' is not valid UTF-8")


def test_jsonl_on_s3(s3_server, tmp_path):
    from tests.driver.helpers import new_bucket

    bucket = new_bucket(s3_server)
    opts = s3_server["storage_options"]
    with fsspec.open(f"s3://{bucket}/in/d.jsonl", "w", **opts) as fh:
        fh.write(JSONL)
    [f] = list_input(f"s3://{bucket}/in/", opts, "jsonl")
    assert f.url == f"s3://{bucket}/in/d.jsonl" and f.num_rows == 3
    assert read_input_rows(f.url, opts, "jsonl", 2, 3, ["id"]).to_pylist() == [
        {"id": "c", ROW_ERROR: None, ROW_INDEX: 2}]


def test_a_rewritten_file_is_read_again(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "one"}\n')
    assert read_input_rows(str(path), {}, "auto", 0, 1, ["prompt"]).column("prompt").to_pylist() == ["one"]
    path.write_text('{"prompt": "two, longer"}\n')
    assert read_input_rows(str(path), {}, "auto", 0, 1, ["prompt"]).column("prompt").to_pylist() == ["two, longer"]
