"""A JSONL line that cannot be read keeps the id its text shows (the id column's value, when it appears once),
so its error row carries the id the user wrote; a line showing none gets the derived `<stem>:<row>` id that
every row of a file without an id column gets, and its error names the line."""

from __future__ import annotations

from jobrunner.driver.rows import job_sampling, to_request
from jobrunner.io.reader import ROW_ERROR, ROW_INDEX
from jobrunner.io.text_input import read_input_rows
from jobrunner.spec import spec_from_dict

LINES = [
    '{"id": "a", "prompt": "fine"}',
    '{"id": "b", "prompt": "cut off',  # not JSON, but its id reads
    "",
    '{"prompt": "no id here", oops}',  # not JSON, no id
    '{"id": "d", "prompt": ["a list where strings are"]}',  # JSON, a value of the wrong type
]


def test_unreadable_lines_keep_the_id_their_text_shows(tmp_path):
    (tmp_path / "in.jsonl").write_text("\n".join(LINES) + "\n")
    spec = spec_from_dict({"name": "t", "input": {"url": str(tmp_path / "in.jsonl"), "prompt_column": "prompt",
                                                  "id_column": "id"}, "output": {"url": str(tmp_path / "out")}})
    table = read_input_rows(str(tmp_path / "in.jsonl"), {}, "jsonl", 0, 4, ["id", "prompt"])
    sampling = job_sampling(spec)
    requests = [to_request(spec, "in", row, sampling) for row in table.to_pylist()]
    assert [r.row_id for r in requests] == ["a", "b", "in:2", "d"]
    assert requests[0].error is None
    assert requests[1].error.startswith("line 2 is not valid JSON")
    assert requests[2].error.startswith("line 4 is not valid JSON")  # row 2 of the file (blank lines skipped)
    assert requests[3].error == "line 5: field 'prompt' is a list where most lines have a string"
    assert table.column(ROW_INDEX).to_pylist() == [0, 1, 2, 3] and table.column(ROW_ERROR).null_count == 1


def test_a_limited_run_checks_only_the_limited_rows_ids(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import pytest

    from jobrunner.driver.plan import plan_job
    from jobrunner.io.reader import InputError

    ids = [f"r{i}" for i in range(40)] + ["r3"]  # the repeat is past the first 30 rows
    pq.write_table(pa.table({"id": ids, "prompt": ["p"] * len(ids)}), tmp_path / "in.parquet", row_group_size=8)
    spec = {"name": "t", "input": {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt",
                                   "id_column": "id", "limit": 30}, "output": {"url": str(tmp_path / "out")}}
    assert plan_job(spec_from_dict(spec)).num_rows == 30
    spec["input"]["limit"] = 41
    with pytest.raises(InputError, match="duplicate ids"):
        plan_job(spec_from_dict(spec))
