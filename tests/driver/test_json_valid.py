"""The json_valid output column, finish reasons in the run summary, and the warning when many rows hit
max_tokens: unit level, then one whole job on the fake engine (local Ray) and its report."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobrunner.driver.job import run_job
from jobrunner.driver.json_check import json_valid
from jobrunner.driver.result import JobResult
from jobrunner.driver.rows import RowRequest, has_json_valid, job_output_schema, job_sampling, output_row
from jobrunner.engine import SamplingParams
from jobrunner.engine.request import RequestMetrics, RequestOutput
from jobrunner.io.parts import read_output
from jobrunner.io.report_reader import open_outputs
from jobrunner.reports.build import build_report
from jobrunner.reports.text import render_text
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import fake_spec

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0}},
          "required": ["answer"], "additionalProperties": False}


@pytest.mark.parametrize(("text", "expected"), [
    ('{"answer": 4}', True),
    ('{"answer": -1}', False),  # JSON, but not what the schema allows
    ('{"answer": 4, "why": "x"}', False),  # additionalProperties false
    ('{"answer": ', False),  # cut at max_tokens mid-value: not JSON at all
    ("", False),
])
def test_json_valid_parses_then_validates_against_the_schema(text, expected):
    assert json_valid(text, SCHEMA) is expected


def test_json_valid_is_null_without_a_schema_or_text():
    assert json_valid('{"answer": 4}', None) is None
    assert json_valid(None, SCHEMA) is None


def test_a_schema_jsonschema_cannot_follow_leaves_the_row_null_not_failed():
    assert json_valid('{"a": 1}', {"$ref": "https://example.invalid/nowhere.json"}) is None


def _spec(**sections):
    base = {"name": "t", "input": {"url": "x", "prompt_column": "prompt", "id_column": "id"},
            "output": {"url": "o"}, "sampling": {"max_tokens": 8}}
    for key, value in sections.items():
        base[key] = {**base[key], **value}
    return spec_from_dict(base)


def _out(text: str, reason: str = "stop") -> RequestOutput:
    return RequestOutput(request_id="r", prompt_token_ids=[1, 2], output_token_ids=[3], text=text,
                         finish_reason=reason, error=None, metrics=RequestMetrics(arrival_time=0.0))


def test_the_column_exists_only_where_rows_can_have_a_schema():
    plain = _spec()
    assert not has_json_valid(plain) and "json_valid" not in job_output_schema(plain).names
    assert "json_valid" not in output_row(plain, RowRequest("a", 0, "p", job_sampling(plain)), _out("x"))
    with_schema = _spec(sampling={"json_schema": SCHEMA})
    per_row = _spec(input={"sampling_column": "params"})
    for spec in (with_schema, per_row):
        assert has_json_valid(spec)
        assert job_output_schema(spec).field("json_valid").type == pa.bool_()


def test_output_rows_carry_json_valid_for_rows_with_a_schema():
    spec = _spec(input={"sampling_column": "params"})
    schema_params = SamplingParams(max_tokens=8, json_schema=SCHEMA)
    rows = [output_row(spec, RowRequest("a", 0, "p", schema_params), _out('{"answer": 7}')),
            output_row(spec, RowRequest("b", 1, "p", schema_params), _out('{"answer": 1', "length")),
            output_row(spec, RowRequest("c", 2, "p", SamplingParams(max_tokens=8)), _out("free text"))]
    assert [r["json_valid"] for r in rows] == [True, False, None]


def test_the_summary_warns_when_many_rows_stop_at_max_tokens():
    manifest = {"job_name": "j", "wall_s": 1.0, "totals": {"rows": 100, "num_errors": 0, "shards_committed": 1,
                                                          "shards_total": 1, "num_output_tokens": 10}}
    few = JobResult("out", manifest, {}, finish_reasons={"stop": 95, "length": 5}, max_tokens=64)
    assert few.row_warnings() == [] and "WARNING" not in few.summary()
    many = JobResult("out", manifest, {}, finish_reasons={"stop": 94, "length": 6}, json_invalid=3,
                     max_tokens=64)
    assert many.row_warnings() == [
        "6 of 100 rows of this run (6.0%) stopped at the token limit (sampling.max_tokens=64) before the model "
        "ended them: raise sampling.max_tokens if their answers are cut (finish_reason 'length' in the output)",
        "3 rows of this run are not valid JSON for their schema (json_valid false in the output; most often cut "
        "at max_tokens)"]
    assert many.summary().count("\n  WARNING: ") == 2
    assert many.ok  # a warning, not a failure


@pytest.mark.timeout(600)
def test_a_job_writes_json_valid_and_its_summary_and_report_name_the_truncated_rows(local_ray, tmp_path):
    # the fake engine writes "tok0 tok1 ..." and stops every row at max_tokens: rows with a schema are
    # json_valid false, rows without one null; the run's summary and the report both say so
    params = [{"json_schema": SCHEMA} if i % 2 == 0 else None for i in range(10)]
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(10)], "prompt": [f"q {i}" for i in range(10)],
                             "params": params}), tmp_path / "in.parquet")
    data = fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out"),
                     input={"sampling_column": "params", "rows_per_shard": 4}, output={"keep_columns": []})
    result = run_job(spec_from_dict(data), show_progress=False)
    assert result.ok, result.summary()
    assert result.finish_reasons == {"length": 10} and result.json_invalid == 5
    summary = result.summary()
    assert "10 of 10 rows of this run (100.0%) stopped at the token limit (sampling.max_tokens=4)" in summary
    assert "5 rows of this run are not valid JSON for their schema" in summary
    rows = {r["id"]: r for r in read_output(str(tmp_path / "out")).to_pylist()}
    assert {i: rows[f"r{i}"]["json_valid"] for i in range(10)} == {
        i: (False if i % 2 == 0 else None) for i in range(10)}
    report = build_report(open_outputs(str(tmp_path / "out")))
    assert report["rows"]["finish_reasons"] == {"length": 10}
    assert report["rows"]["stopped_at_max_tokens"] == 10 and report["rows"]["stopped_at_max_tokens_rate"] == 1.0
    assert (report["rows"]["json_checked"], report["rows"]["json_invalid"]) == (5, 5)
    assert report["rows"]["json_valid_rate"] == 0.0
    assert any("10 of 10 rows (100.0%) stopped at the token limit (sampling.max_tokens=4)" in w
               for w in report["warnings"])
    text = render_text([report])
    assert "finish reasons: length 10" in text
    assert "not schema-valid JSON" in text and "stopped at max_tokens (finish_reason length)" in text
    assert json.loads(json.dumps(report["rows"]))  # plain JSON values only
