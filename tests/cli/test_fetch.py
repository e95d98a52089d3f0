"""`jobrunner fetch`: a model source put in the cache ahead of a job; a bad source named in the error."""

from pathlib import Path

from click.testing import CliRunner

from jobrunner.cli import main


def test_fetch_prints_each_model_dir_and_names_a_bad_source(tiny_llama_hf_dir: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["fetch", str(tiny_llama_hf_dir), "--cache-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"{tiny_llama_hf_dir}: {tiny_llama_hf_dir} (")

    result = CliRunner().invoke(main, ["fetch", str(tiny_llama_hf_dir), "no-such-alias-x"])
    assert result.exit_code == 1
    assert "fetch no-such-alias-x: model source 'no-such-alias-x' is not a known alias" in result.output


def test_fetch_needs_a_source() -> None:
    result = CliRunner().invoke(main, ["fetch"])
    assert result.exit_code == 2 and "Missing argument 'SOURCES...'" in result.output
