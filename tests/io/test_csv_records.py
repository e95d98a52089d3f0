"""Strict CSV records (io/csv_records.py): a bad record is one error row naming its line, and never swallows the
rows after it (issue 47: `c4,"unterminated` ate row c5, and validate said 4 rows)."""

from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner

from jobrunner.cli import main
from jobrunner.io.csv_records import CsvRecord, csv_records, csv_shape
from jobrunner.io.reader import ROW_ERROR
from jobrunner.io.text_input import _parse
from jobrunner.io.text_lines import row_line_numbers

UNCLOSED = 'id,prompt\nc1,one\nc2,two\nc3,three\nc4,"unterminated\nc5,after\n'
NEVER_CLOSED = ("line 5: a quote opened in this record is never closed (the lines after it are read as rows of "
                "their own)")


def _rows(text: str) -> list[dict]:
    return _parse(text.encode(), "csv", "mem://x.csv").to_pylist()


def test_an_unclosed_quote_is_its_rows_error_and_the_next_rows_stay():
    rows = _rows(UNCLOSED)
    assert [r["id"] for r in rows] == ["c1", "c2", "c3", "c4", "c5"]
    assert rows[3] == {"id": "c4", "prompt": None, ROW_ERROR: NEVER_CLOSED}
    assert rows[4] == {"id": "c5", "prompt": "after", ROW_ERROR: None}
    assert row_line_numbers(UNCLOSED.encode(), "csv") == [2, 3, 4, 5, 6]


def test_a_quote_that_closes_inside_a_value_names_the_record_and_where_it_broke():
    text = 'id,prompt,topic\nc1,one,t\nc4,"bad,t\nc5,after,t\nc6,x"y,t\nc7,"ok, fine",t\n'
    rows = _rows(text)
    assert [r["id"] for r in rows] == ["c1", "c4", "c5", "c6", "c7"]
    assert rows[1][ROW_ERROR] == "line 3: not a valid CSV record: ',' expected after '\"' (at line 5)"
    assert rows[1]["prompt"] is None and rows[1]["topic"] is None
    assert rows[3]["prompt"] == 'x"y' and rows[4]["prompt"] == "ok, fine"  # a quote inside a plain value is text
    assert row_line_numbers(text.encode(), "csv") == [2, 3, 4, 5, 6]


def test_a_broken_quote_in_the_first_column_keeps_no_cell():
    rows = _rows('id,prompt\n"a" b,one\nc2,two\n')
    assert rows[0] == {"id": None, "prompt": None, ROW_ERROR: "line 2: not a valid CSV record: ',' expected after '\"'"}
    assert rows[1]["id"] == "c2"


@pytest.mark.parametrize("end", ["\n", "\r\n"])
def test_valid_quoting_reads_as_before(end):
    big = "x" * 200_000  # past the csv module's default field limit (128 KiB)
    text = end.join(["id,prompt", 'c1,"multi', 'line, with ""quotes"""', "", f'c2,"{big}"', "c3,plain", ""])
    rows = _rows(text)
    assert [(r["id"], r["prompt"]) for r in rows] == [("c1", f'multi{end}line, with "quotes"'), ("c2", big),
                                                      ("c3", "plain")]
    assert csv_shape(text.encode()) == (3, True)
    assert row_line_numbers(text.encode(), "csv") == [2, 5, 6]


def test_records_restart_after_a_bad_one():
    assert list(csv_records('a,b\n1,"x\n2,y\n')) == [
        CsvRecord(1, ["a", "b"]), CsvRecord(2, ["1"], "line 2: a quote opened in this record is never closed "
                                                        "(the lines after it are read as rows of their own)"),
        CsvRecord(3, ["2", "y"])]
    assert csv_shape(b'a,b\n1,"x\n2,y\n') is None and csv_shape(b"a,b\n1,2\n") == (1, False)


def test_validate_counts_the_bad_record_and_the_rows_after_it(tmp_path):
    (tmp_path / "c.csv").write_text(UNCLOSED)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "t", "input": {"url": str(tmp_path / "c.csv"), "prompt_column": "prompt",
                                                          "id_column": "id"},
                                   "output": {"url": str(tmp_path / "out")}}))
    result = CliRunner().invoke(main, ["validate", str(job)])
    assert result.exit_code == 0, result.output
    assert f"c.csv: 5 rows, 1 row group(s), 1 bad line(s) (each becomes an error row): {NEVER_CLOSED}" in result.output
