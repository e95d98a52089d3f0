"""What `validate` and `run` print and write, with secrets planted where users put them: a model source's
userinfo and `?token=` query, factory options under the names hosted clients use (hub_pass, passphrase,
accesstoken, apiToken, SENTRY_DSN) and a token that YAML parsed into a mapping key. None may come out; the
redaction marker shows where each one was."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from jobrunner.cli import main

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.driver.helpers import fake_spec, write_prompts  # noqa: E402

pytestmark = pytest.mark.timeout(600)

SECRETS = {"source password": "JRsourcePassword", "source query": "JRsourceQuery", "hub_pass": "JRhubPass",
           "passphrase": "JRpassphrase", "accesstoken": "JRaccessToken", "apiToken": "JRapiToken",
           "dsn": "JRsentryDsnKey", "key token": "hf_JRkeyTokenAbcdefghijklmnop"}
SOURCE = f"https://jr:{SECRETS['source password']}@models.example.com/m?token={SECRETS['source query']}"
SHOWN_SOURCE = "https://***@models.example.com/m?token=***"


def _job(tmp_path) -> Path:
    write_prompts(tmp_path / "in.parquet", 8)
    data = fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out"), model={"source": SOURCE},
                     engine={"max_num_seqs": 4, "factory": "tests.driver.secret_engine:make_engine_with_credentials"},
                     cluster={"num_workers": 1})
    options = {"hub_pass": SECRETS["hub_pass"], "passphrase": SECRETS["passphrase"],
               "accesstoken": SECRETS["accesstoken"], "apiToken": SECRETS["apiToken"],
               "SENTRY_DSN": f"https://{SECRETS['dsn']}@sentry.example.com/1"}
    text = yaml.safe_dump(data).replace("factory_options: {}", f"factory_options: {json.dumps(options)}")
    path = tmp_path / "job.yaml"
    path.write_text(text.replace("factory_options: {", f"factory_options: {{{SECRETS['key token']}: 1, ", 1))
    return path


def _leaks(texts: dict[str, str]) -> list[tuple[str, str]]:
    return [(place, name) for place, text in texts.items() for name, secret in SECRETS.items() if secret in text]


def test_validate_prints_the_model_source_without_its_credentials(tmp_path):
    job = _job(tmp_path)
    assert SECRETS["key token"] in job.read_text() and SECRETS["hub_pass"] in job.read_text()
    result = CliRunner().invoke(main, ["validate", str(job)])
    assert result.exit_code == 0, result.output
    assert _leaks({"output": result.output}) == []
    assert result.output.splitlines()[:2] == [
        "job 'fake-job': spec OK",
        f"model '{SHOWN_SOURCE}' (not checked: engine.factory "
        "tests.driver.secret_engine:make_engine_with_credentials builds the engine)"]


def test_run_prints_and_writes_no_credential(tmp_path):
    result = CliRunner().invoke(main, ["run", str(_job(tmp_path))])  # progress on: its stage lines too
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    files = {str(p): p.read_text(errors="replace") for p in out.rglob("*") if p.is_file() and p.suffix != ".parquet"}
    assert str(out / "_report" / "report.json") in files
    assert _leaks({"output": result.output, **files}) == []
    assert f"[jobrunner] worker w0 placed; loading model {SHOWN_SOURCE}" in result.output.splitlines()
    manifest = json.loads(files[str(out / "_manifest.json")])
    assert manifest["model"]["source"] == SHOWN_SOURCE
    assert manifest["spec"]["engine"]["factory_options"] == {
        "***": 1, "hub_pass": "***", "passphrase": "***", "accesstoken": "***", "apiToken": "***",
        "SENTRY_DSN": "***"}
