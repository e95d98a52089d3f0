"""Smoke runs (`--limit` / input.limit) and errors that help, through click's CliRunner."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from jobrunner.cli import main

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.driver.helpers import fake_spec, new_bucket, read_manifest_file, write_prompts  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def _job(tmp_path, name: str = "job.yaml", **sections) -> Path:
    if not (tmp_path / "in.parquet").exists():
        write_prompts(tmp_path / "in.parquet", 24)
    data = fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out"), **sections)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def _output_ids(out: Path) -> list[str]:
    return sorted(pq.read_table(out / "parts", columns=["id"]).column("id").to_pylist())


def test_validate_with_limit_plans_only_the_first_rows(tmp_path):
    result = CliRunner().invoke(main, ["validate", str(_job(tmp_path)), "--limit", "11"])
    assert result.exit_code == 0, result.output
    assert "11 rows (the first 11: input.limit), 2 shard(s)" in result.output
    assert "not checked: engine.factory" in result.output  # a custom factory may take any model source


def test_run_limit_is_deterministic_and_recorded(tmp_path):
    runner = CliRunner()
    job = _job(tmp_path, cluster={"num_workers": 1})
    first = runner.invoke(main, ["run", str(job), "--limit", "5", "--no-progress", "--no-report"])
    assert first.exit_code == 0, first.output
    assert _output_ids(tmp_path / "out") == ["p000", "p001", "p002", "p003", "p004"]
    manifest = read_manifest_file(tmp_path / "out")
    assert manifest["spec"]["input"]["limit"] == 5 and manifest["totals"]["rows"] == 5
    again = runner.invoke(main, ["run", str(job), "--set", "output.url=" + str(tmp_path / "out2"),
                                 "--set", "input.limit=5", "--no-progress", "--no-report"])
    assert again.exit_code == 0, again.output
    assert _output_ids(tmp_path / "out2") == _output_ids(tmp_path / "out")
    full = runner.invoke(main, ["run", str(job), "--no-progress", "--no-report"])  # same output, resume mode
    assert full.exit_code == 1
    assert "input.limit: 5 -> None" in full.output and full.output.count("Error:") == 1
    assert len(_output_ids(tmp_path / "out")) == 5  # the smoke run's output is left as it was


def test_set_errors_name_the_set_and_suggest_the_key(tmp_path):
    job = _job(tmp_path)
    bad = CliRunner().invoke(main, ["validate", str(job), "--set", "sampling.max_tokenz=5"])
    assert bad.exit_code == 1
    assert f"invalid --set for {job}:" in bad.output
    assert ("--set sampling.max_tokenz=5: sampling.max_tokenz: unknown field (not allowed); did you mean "
            "'max_tokens'?") in bad.output
    assert bad.output.count("Error:") == 1 and bad.output.count("max_tokenz=5") == 1
    value = CliRunner().invoke(main, ["validate", str(job), "--set", "sampling.max_tokens=lots"])
    assert "--set sampling.max_tokens=lots: sampling.max_tokens: Input should be a valid integer" in value.output


def test_file_errors_name_the_file_and_suggest_the_key(tmp_path):
    job = _job(tmp_path)
    data = yaml.safe_load(job.read_text())
    data["sampeling"] = data.pop("sampling")
    data["input"]["prompt_colum"] = data["input"].pop("prompt_column")
    job.write_text(yaml.safe_dump(data))
    bad = CliRunner().invoke(main, ["validate", str(job)])
    assert bad.exit_code == 1 and f"{job}: invalid job spec:" in bad.output
    assert "sampeling: unknown field (not allowed); did you mean 'sampling'?" in bad.output
    assert "input.prompt_colum: unknown field (not allowed); did you mean 'prompt_column'?" in bad.output


def test_model_typo_fails_in_validate_and_before_run_starts_workers(tmp_path):
    job = _job(tmp_path)
    typo = ["--set", "engine.factory=null", "--set", "model.source=smollm2-135m-instruc"]
    for command in (["validate", str(job)], ["run", str(job), "--no-progress"]):
        result = CliRunner().invoke(main, command + typo)
        assert result.exit_code == 1, result.output
        assert "model.source: model source 'smollm2-135m-instruc' is not a known alias" in result.output
        assert "did you mean the alias 'smollm2-135m-instruct'?" in result.output
        assert result.output.count("Error:") == 1
    assert not (tmp_path / "out").exists()  # run stopped before opening the output or starting Ray
    local = CliRunner().invoke(main, ["validate", str(job), "--set", "engine.factory=null",
                                      "--set", f"model.source={tmp_path}"])
    assert local.exit_code == 1 and f"{tmp_path} has no config.json" in local.output
    hub = CliRunner().invoke(main, ["validate", str(job), "--set", "engine.factory=null",
                                    "--set", "model.source=HuggingFaceTB/SmolLM2-135M-Instruct"])
    assert hub.exit_code == 0, hub.output
    assert "model Hugging Face Hub id 'HuggingFaceTB/SmolLM2-135M-Instruct'" in hub.output
    # no network here: the config is not checked, which validate says at once instead of failing
    assert "config not checked: the Hugging Face Hub (huggingface.co)" in hub.output


def test_relative_input_path_says_relative_to_what(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = _job(tmp_path, input={"url": "data/missing.parquet"})
    result = CliRunner().invoke(main, ["validate", str(job)])
    assert result.exit_code == 1
    assert (f"note: input.url 'data/missing.parquet' is a relative path: it is read from the current directory "
            f"({tmp_path}), not from the spec file's directory") in result.output


def test_missing_s3_credentials_fail_fast_saying_what_to_set(s3_server, tmp_path, monkeypatch, caplog):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    bucket = new_bucket(s3_server)
    no_keys = {"endpoint_url": s3_server["endpoint_url"]}
    job = _job(tmp_path, input={"url": f"s3://{bucket}/in.parquet", "storage_options": no_keys})
    result = CliRunner().invoke(main, ["validate", str(job)])
    assert result.exit_code == 1
    assert "NoCredentialsError" in result.output
    assert "S3 needs credentials. Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE" in result.output
    assert "the options key and secret in the spec's storage_options" in result.output
    assert "endpoint_url" in result.output and "***" not in result.output
    assert "retrying" not in caplog.text  # credentials do not appear by retrying
    assert [line for line in result.output.splitlines() if line.startswith("Error:")] == \
        [result.output.splitlines()[0]]


def test_credential_errors_are_recognised_through_the_cause_chain():
    from jobrunner.io.storage import credential_help, is_credential_error

    class NoCredentialsError(Exception):
        pass

    try:
        try:
            raise NoCredentialsError("Unable to locate credentials")
        except NoCredentialsError as inner:
            raise OSError("wrapped") from inner
    except OSError as outer:
        assert is_credential_error(outer)
    assert not is_credential_error(ConnectionError("connection reset"))
    assert "GOOGLE_APPLICATION_CREDENTIALS" in credential_help("read gs://b/x")
    assert "AZURE_STORAGE_CONNECTION_STRING" in credential_help("read az://c/x")


def test_over_budget_failure_is_printed_once(tmp_path):
    job = _job(tmp_path, cluster={"max_shard_attempts": 1, "num_workers": 1}, output={"max_error_rate": 0.0},
               engine={"factory_options": {"fail_on": "POISON"}})
    write_prompts(tmp_path / "in.parquet", 24, poison=2)
    result = CliRunner().invoke(main, ["run", str(job), "--no-progress", "--no-report"])
    assert result.exit_code == 1
    assert result.output.count("of rows are errors (output.max_error_rate=0)") == 1
