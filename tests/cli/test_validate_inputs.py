"""`jobrunner validate` on an input folder holding an empty file (listed as skipped, the job is valid) and on
an output inside the input (refused in the default resume mode, naming both URLs)."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from click.testing import CliRunner

from jobrunner.cli import main

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.driver.helpers import fake_spec, write_prompts  # noqa: E402


def _job(tmp_path, output_url: str) -> Path:
    write_prompts(tmp_path / "in" / "real.parquet", 8)
    (tmp_path / "in" / "empty.parquet").write_bytes(b"")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(fake_spec(str(tmp_path / "in"), output_url)))
    return path


def test_an_empty_file_is_listed_as_skipped(tmp_path):
    result = CliRunner().invoke(main, ["validate", str(_job(tmp_path, str(tmp_path / "out")))])
    assert result.exit_code == 0, result.output
    assert [line for line in result.output.splitlines() if line.startswith("  ")] == [
        f"  file://{tmp_path}/in/empty.parquet (0 bytes): empty, skipped",
        f"  file://{tmp_path}/in/real.parquet: 8 rows, 1 row group(s)"]


def test_an_output_inside_the_input_is_refused_in_resume_mode(tmp_path):
    out = tmp_path / "in" / "results"
    result = CliRunner().invoke(main, ["validate", str(_job(tmp_path, str(out)))])
    assert result.exit_code == 1
    assert result.output == (
        f"Error: output.url '{out}' is or lies inside input.url '{tmp_path / 'in'}' (resolved: {out}), which is "
        "read recursively: the job's parts would be read back as input by the next run; use an output.url "
        "outside the input\n")
