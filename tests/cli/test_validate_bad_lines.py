"""`jobrunner validate` counts a text input's bad lines and quotes the first few, each naming its line."""

from __future__ import annotations

import yaml
from click.testing import CliRunner

from jobrunner.cli import main


def test_validate_counts_and_names_bad_lines(tmp_path):
    good = [f'{{"id": "r{i}", "prompt": "question {i}"}}' for i in range(6)]
    lines = good[:2] + ['{"id": "x1", "prompt": "cut'] + good[2:4] + ["not json"] + good[4:] + [
        '{"id": "x3", "prompt": 7}', '{"id": "x4", "prompt": ["list"]}']
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "t", "input": {"url": str(tmp_path / "in.jsonl"), "prompt_column": "prompt",
                                                          "id_column": "id"},
                                   "output": {"url": str(tmp_path / "out")}}))
    result = CliRunner().invoke(main, ["validate", str(job)])
    assert result.exit_code == 0, result.output
    assert "in.jsonl: 10 rows, 1 row group(s), 4 bad line(s) (each becomes an error row): line 3 is not valid " \
           "JSON" in result.output
    assert "; line 6 is not valid JSON" in result.output and "; line 9: field 'prompt' is a number where most " \
           "lines have a string; ... 1 more" in result.output
