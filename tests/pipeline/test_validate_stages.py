"""`jobrunner validate` of a pipeline: each stage described, template and filter columns checked against what the
stage before can hold (no worker, no Ray)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from click.testing import CliRunner

from jobrunner.cli import main


def _spec(tmp_path, judge_prompt: str, last_filter: str) -> str:
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["x", "y"], "topic": ["t", "u"]}), tmp_path / "in.parquet")
    spec = {"name": "v", "input": {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt", "id_column": "id"},
            "engine": {"factory": "tests.driver.fake_engine:make_engine"}, "output": {"url": str(tmp_path / "out")},
            "stages": [{"name": "gen", "filter": "topic != 'u'"},
                       {"name": "judge", "input": {"prompt": judge_prompt}, "output_columns": {"score": "json.score"},
                        "filter": "json_valid and score >= 5"},
                       {"name": "polish", "input": {"messages": [{"role": "user", "content": "Again ({score})"}]},
                        "filter": last_filter}]}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_validate_describes_the_stages_and_accepts_columns_that_exist(tmp_path):
    result = CliRunner().invoke(main, ["validate", _spec(tmp_path, "{topic}: {prompt} -> {generated_text}",
                                                         "judge.json_valid and gen.generated_text != null")])
    assert result.exit_code == 0, result.output
    assert "pipeline: 3 stage(s)" in result.output
    assert "stage judge: task generate, reads a prompt template; output_columns score; filter" in result.output
    assert "stage polish: task generate, reads 1 message(s) appended" in result.output


def test_validate_names_a_column_no_row_can_hold(tmp_path):
    result = CliRunner().invoke(main, ["validate", _spec(tmp_path, "{topc}: {generated_text}", "json_valid")])
    assert result.exit_code == 1
    assert ("stages[1] (judge): input.prompt: column 'topc' never exists in the rows of stage gen (they have: "
            "finish_reason, generated_text, id, prompt, reasoning, topic)") in result.output
    # the judge's json_valid is carried as judge.json_valid: the last stage's own rows have no json_valid
    assert "stages[2] (polish): filter: column 'json_valid' never exists in stage polish's own rows" in result.output
