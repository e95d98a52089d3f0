"""Incremental runs whose row ids are derived ('<file-stem>:<row>'): the nightly `{date}` pattern without an id
column, and null ids in an id column, through `validate` and `run` (issue 47: both used to crash in
io/done_rows.py joining a large string with a plain one)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from jobrunner.cli import main
from jobrunner.driver.job import run_job
from jobrunner.io.done_rows import row_ids
from jobrunner.io.ids import ids_or_derived
from jobrunner.io.parts import read_output
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import fake_spec

pytestmark = pytest.mark.timeout(600)


def test_row_ids_derive_the_missing_ones_as_the_output_names_them():
    table = pa.table({"id": pa.array(["a", None, "c", None], pa.large_string())})
    assert row_ids(table, 10, "night", "id").to_pylist() == ["a", "night:11", "c", "night:13"]
    assert row_ids(table, 0, "night", None).to_pylist() == ["night:0", "night:1", "night:2", "night:3"]
    assert row_ids(pa.table({"id": [7, None]}), 0, "f", "id").to_pylist() == ["7", "f:1"]
    chunked = pa.chunked_array([pa.array(["x", None]), pa.array([None, "y"])])
    assert ids_or_derived(chunked, "s", 4, 4).to_pylist() == ["x", "s:5", "s:6", "y"]


def _nightly(tmp_path, id_column: str | None = None) -> dict:
    data = fake_spec(str(tmp_path / "in" / "{date}"), str(tmp_path / "nightly" / "{date}"),
                     cluster={"num_workers": 1},
                     output={"mode": "incremental", "skip_done_from": [str(tmp_path / "nightly" / "*")],
                             "keep_columns": [], "max_error_rate": 1.0})
    data["input"]["id_column"] = id_column
    return data


def _night(tmp_path, date: str, monkeypatch, files: dict[str, dict[str, list]]) -> None:
    """Tonight's input folder in/<date>/ with these files (name -> columns); JOBRUNNER_DATE set to it."""
    folder = tmp_path / "in" / date
    folder.mkdir(parents=True, exist_ok=True)
    for name, columns in files.items():
        pq.write_table(pa.table({k: pa.array(v, pa.string()) for k, v in columns.items()}), folder / name)
    monkeypatch.setenv("JOBRUNNER_DATE", date)


def _validate(tmp_path, data: dict) -> str:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(main, ["validate", str(job)])
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def test_the_nightly_date_pattern_without_an_id_column(local_ray, tmp_path, monkeypatch):
    """The docs' nightly pattern: a dated input folder, no id column. A file named as last night's repeats its
    derived ids: its rows are skipped as done (each id once), flagged with what to do; a new name is taken."""
    from jobrunner.driver.incremental import DERIVED_HINT

    data = _nightly(tmp_path)
    _night(tmp_path, "2026-12-01", monkeypatch, {"prompts.parquet": {"prompt": [f"old {i}" for i in range(5)]}})
    assert "incremental: taking 5 of 5 input rows; 0 skipped as done" in _validate(tmp_path, data)
    result = run_job(spec_from_dict(data), show_progress=False)
    assert result.ok, result.summary()
    out = read_output(str(tmp_path / "nightly" / "2026-12-01")).to_pylist()
    assert sorted(r["id"] for r in out) == [f"prompts:{i}" for i in range(5)]
    assert all(r["error"] is None for r in out)

    _night(tmp_path, "2026-12-02", monkeypatch, {"prompts.parquet": {"prompt": [f"new {i}" for i in range(3)]},
                                                 "2026-12-02.parquet": {"prompt": ["a", "b"]}})
    said = _validate(tmp_path, data)
    assert "incremental: taking 2 of 5 input rows; 3 skipped as done (5 done ids: 5 in " in said
    assert "3 done id(s) whose request changed" in said and DERIVED_HINT in said


def test_null_ids_in_an_incremental_run_are_derived_and_done_once(local_ray, tmp_path, monkeypatch):
    data = _nightly(tmp_path, id_column="id")
    _night(tmp_path, "2026-12-01", monkeypatch, {"n.parquet": {"id": ["a", None, "c", None],
                                                               "prompt": ["x", "y", "z", "w"]}})
    assert "incremental: taking 4 of 4 input rows; 0 skipped as done" in _validate(tmp_path, data)
    result = run_job(spec_from_dict(data), show_progress=False)
    assert result.ok, result.summary()
    rows = {r["id"]: r["error"] for r in read_output(str(tmp_path / "nightly" / "2026-12-01")).to_pylist()}
    assert rows == {"a": None, "c": None, "n:1": "id column 'id' is null (row n:1)",
                    "n:3": "id column 'id' is null (row n:3)"}
    # the same night again: every id, the derived ones too, is done (an error row counts as done)
    assert "incremental: taking 0 of 4 input rows; 4 skipped as done (4 done ids: 4 in " in _validate(tmp_path, data)
