"""Secrets never leave the process: one test per place text is written down or shown. Each plants a secret,
then checks it is absent AND that the redaction marker took its place (a no-op redactor fails every test).
The whole-job searches (every file, every log) are test_secrets_job.py (run) and test_submit_head.py (submit)."""

from __future__ import annotations

import json
import logging

import pytest
import yaml
from click.testing import CliRunner

from jobrunner.cli import main
from jobrunner.driver.engine_factory import describe_model
from jobrunner.driver.manifest import JobBook, new_manifest
from jobrunner.driver.result import JobResult
from jobrunner.driver.shards import Shard, ShardTable
from jobrunner.driver.worker import error_kinds
from jobrunner.io.manifest import read_manifest_with_records
from jobrunner.io.reader import file_stem
from jobrunner.io.storage import RETRY_WARNINGS, Storage, retry
from jobrunner.models.sources import ModelSourceError, resolve_model_dir
from jobrunner.redaction import REDACTED
from jobrunner.spec import SpecError, load_spec, spec_from_dict
from tests.driver.fake_engine import FakeEngine
from tests.driver.helpers import fake_spec

SECRET = "PLANTEDsecretXq"
SOURCE = f"https://jr-user:{SECRET}pw@models.example.com/llama?token={SECRET}q&rev=main"
PRESIGNED = (f"https://b.s3.amazonaws.com/in/prompts.parquet?X-Amz-Date=20261201T000000Z"
             f"&X-Amz-Security-Token={SECRET}sts&X-Amz-Signature=9f8e7d6c5b4a{SECRET}")
QUOTED_ERROR = f'upstream error {{"api_key": "{SECRET}"}}, \'token\': \'{SECRET}\', "password":"{SECRET}"'


def _clean(text: str) -> str:
    assert SECRET not in text, text
    assert REDACTED in text, text
    return text


def _spec(tmp_path, **sections):
    data = fake_spec(PRESIGNED, str(tmp_path / "out"), model={"source": SOURCE}, **sections)
    return spec_from_dict(data)


def _shard() -> Shard:
    return Shard("00000-abc", PRESIGNED, "prompts", 0, 8)


def test_manifest_model_source_and_shard_file(tmp_path):
    shards = ShardTable.from_shards([_shard()])
    manifest = new_manifest(_spec(tmp_path), shards)
    assert manifest["model"]["source"] == "https://***@models.example.com/llama?token=***&rev=main"
    assert _clean(shards.columns.entry(0)["file"]).startswith("https://b.s3.amazonaws.com/in/prompts")
    _clean(json.dumps(manifest))


def test_worker_model_section(tmp_path):
    """The model section a worker reports (merged into the manifest) hides the source's credentials."""
    model = describe_model(FakeEngine(), _spec(tmp_path))
    assert _clean(model["source"]) == "https://***@models.example.com/llama?token=***&rev=main"


def test_error_kinds_of_commit_records_manifest_and_summary(tmp_path):
    """A worker's error kinds are redacted where they are made: commit records, the manifest's totals and the
    run's summary all take them from there."""
    rows = [{"error": QUOTED_ERROR}, {"error": QUOTED_ERROR.replace(SECRET, "another")}, {"error": None}]
    kinds = error_kinds(rows)
    assert kinds == {'upstream error {"api_key": "***"}, \'token\': \'***\', "password":"***"': 2}
    storage = Storage(str(tmp_path / "out"))
    shards = ShardTable.from_shards([_shard()])
    book = JobBook(storage, new_manifest(_spec(tmp_path), shards), shards, background=False)
    book.commit("00000-abc", {"rows": 3, "num_errors": 2, "part": "parts/part-00000-abc.parquet"}, kinds)
    _clean((tmp_path / "out" / "_commits" / "00000-abc.json").read_text())
    book.compact()
    _clean((tmp_path / "out" / "_manifest.json").read_text())
    table_files = list((tmp_path / "out" / "_shards").glob("*.parquet"))  # the shard table, as bytes
    assert table_files and all(SECRET.encode() not in f.read_bytes() for f in table_files)
    _clean(json.dumps(read_manifest_with_records(storage)))


def test_storage_retry_warning(caplog):
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError(f"GET {PRESIGNED} reset; password={SECRET}")
        return "ok"

    RETRY_WARNINGS.flush()  # a retry of this cause an earlier test logged would fold this one (io/repeats.py)
    with caplog.at_level(logging.WARNING, logger="jobrunner.io.storage"):
        assert retry(f"read {PRESIGNED}", flaky, backoff_s=0.0) == "ok"
    assert "attempt 1 failed" in _clean(caplog.text)


def test_job_result_summary_and_failure_message():
    manifest = {"job_name": "j", "wall_s": 1.0, "totals": {"shards_committed": 0, "shards_total": 1, "rows": 4,
                                                            "num_errors": 4, "num_output_tokens": 0}}
    result = JobResult(PRESIGNED, manifest, failed={"00000-abc": f"read {PRESIGNED}: 403"},
                       error=f"worker lost: {QUOTED_ERROR}", top_errors=[(QUOTED_ERROR, 4)])
    assert "JOB ERROR" in _clean(result.summary())
    assert "1 shard(s) failed" in _clean(result.failure_message())


def test_presigned_file_name_is_not_a_row_id_stem():
    assert file_stem("https://b.s3.amazonaws.com/in/prompts.jsonl?X-Amz-Signature=abc&sig=x.y") == "prompts"
    assert file_stem("bucket/in/prompts.v2.parquet") == "prompts.v2"


def test_cli_error_for_an_unreachable_presigned_input(tmp_path):
    url = f"http://jr-user:{SECRET}@127.0.0.1:1/in/prompts.parquet?X-Amz-Signature={SECRET}"
    spec = fake_spec(url, str(tmp_path / "out"))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(main, ["validate", str(tmp_path / "job.yaml")])
    assert result.exit_code == 1 and "input" in _clean(result.output)


def test_spec_yaml_error_quoting_a_secret_line(tmp_path):
    (tmp_path / "bad.yaml").write_text(f'input:\n  storage_options: {{password: "{SECRET}}}\n')
    with pytest.raises(SpecError, match="not valid YAML") as info:
        load_spec(tmp_path / "bad.yaml")
    _clean(str(info.value))


def test_model_source_error(tmp_path):
    with pytest.raises(ModelSourceError) as info:
        resolve_model_dir(f"memory://jr-user:{SECRET}@nowhere/model?token={SECRET}", cache_dir=str(tmp_path))
    _clean(str(info.value))


def test_cli_traceback_of_an_unexpected_error(tmp_path):
    """An error the CLI does not expect (here a corrupt manifest under a folder named like a credential) is
    printed as a redacted traceback, exit 1."""
    from tests.driver.helpers import write_prompts

    write_prompts(tmp_path / "in.parquet", 4)
    out = tmp_path / f"token={SECRET}" / "out"
    out.mkdir(parents=True)
    (out / "_manifest.json").write_text("not json")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(fake_spec(str(tmp_path / "in.parquet"), str(out))))
    result = CliRunner().invoke(main, ["run", str(tmp_path / "job.yaml"), "--no-progress"])
    assert result.exit_code == 1 and "Traceback" in result.output and "ManifestError" in result.output
    _clean(result.output)
