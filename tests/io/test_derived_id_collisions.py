"""A null id's row is named `<file-stem>:<row>` in the output: a real id equal to that name is a duplicate, found
before any work and refused naming both rows (issue 47: two output rows with id `idcoll:3`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobrunner.driver.plan import plan_job
from jobrunner.io.reader import InputError
from jobrunner.io.text_input import find_input_duplicates, list_input
from jobrunner.spec import spec_from_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.driver.helpers import fake_spec  # noqa: E402


def _found(folder) -> list[tuple]:
    files = list_input(str(folder), {}, "auto")
    return [(d.row_id, d.first, d.again, d.derived) for d in find_input_duplicates(files, {}, "auto", "id")]


def test_a_real_id_equal_to_a_null_ids_derived_id(tmp_path):
    pq.write_table(pa.table({"id": ["a", "idcoll:3", None, None, "e"], "prompt": list("abcde")}),
                   tmp_path / "idcoll.parquet")
    assert _found(tmp_path) == [("idcoll:3", (0, 1), (0, 3), (False, True))]


def test_null_ids_of_two_files_with_one_name(tmp_path):
    """a/x.parquet and b/x.parquet: both null ids at row 1 would be 'x:1'; the JSONL line's real id 'x:0' meets
    the first file's null id at row 0 (text and Parquet files alike)."""
    for folder, ids in (("a", ["x:9", None, "p"]), ("b", ["q", None])):
        (tmp_path / folder).mkdir()
        pq.write_table(pa.table({"id": pa.array(ids, pa.string())}), tmp_path / folder / "x.parquet")
    assert _found(tmp_path) == [("x:1", (0, 1), (1, 1), (True, True))]
    (tmp_path / "c.jsonl").write_text('{"id": "x:9"}\n{"id": null}\n')
    assert _found(tmp_path) == [("x:1", (0, 1), (1, 1), (True, True)), ("x:9", (0, 0), (2, 0), (False, False))]


def test_null_ids_alone_are_no_duplicates(tmp_path):
    pq.write_table(pa.table({"id": pa.array([None, "a", None, None], pa.string())}), tmp_path / "n.parquet")
    (tmp_path / "m.jsonl").write_text('{"id": null}\n{"id": "n:4"}\n')
    assert _found(tmp_path) == []


def test_the_planner_refuses_it_before_any_work_naming_both_rows(tmp_path):
    pq.write_table(pa.table({"id": ["a", "idcoll:3", None, None, "e"], "prompt": list("abcde")}),
                   tmp_path / "idcoll.parquet")
    spec = spec_from_dict(fake_spec(str(tmp_path / "idcoll.parquet"), str(tmp_path / "out"),
                                    output={"keep_columns": []}))
    with pytest.raises(InputError) as caught:
        plan_job(spec)
    url = (tmp_path / "idcoll.parquet").as_uri()
    assert str(caught.value) == (
        f"input.id_column 'id': a null id's derived id is another row's id: 'idcoll:3' at {url} row 1 and again "
        f"at {url} row 3 (a null id, derived). A row with a null id is named '<file-stem>:<row>' (and made an "
        "error row), so no other row may carry that id; give the null ids values, or rename the other row")
