"""Secrets by value (issue 47, symptom 12): an engine whose error texts quote its credentials in free text
(`login refused for credential <key> and <pass>`, a dict of every option) with the key from `${env:NAME}` and
options under names users write (`hub_pass`, `passcode`, `conn_str`, `pat`, `url_pw`). No value may reach the
parts' `error` column, the manifest, the report, `status` or what `run` prints; the marker shows where each
was, and a job named `secret-adv` keeps its counts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from jobrunner.cli import main
from jobrunner.spec import spec_from_dict

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.driver.helpers import fake_spec  # noqa: E402

pytestmark = pytest.mark.timeout(600)

SECRETS = {"api_key": "JRv47envSecret42", "hub_pass": "JRv47hubPass77", "passcode": "JRv47passcode",
           "pat": "JRv47pat12345", "url_pw": "JRv47urlPw", "conn_str pwd": "JRv47connPw9"}
OPTIONS = {"api_key": "${env:JR_V47_SECRET}", "hub_pass": SECRETS["hub_pass"], "passcode": SECRETS["passcode"],
           "conn_str": f"Server=db.example.com;Uid=jr;Pwd={SECRETS['conn_str pwd']}", "pat": SECRETS["pat"],
           "url_pw": SECRETS["url_pw"]}
STEMS = [s.rstrip("0123456789") for s in SECRETS.values()]  # error kinds fold digits: look for the stems


def _job(tmp_path: Path) -> Path:
    import pyarrow as pa

    prompts = ["hello", "LOGIN please", "fine", "OPTIONS now", "ok", "LOGIN again"]
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(6)], "prompt": prompts}), tmp_path / "in.parquet")
    data = fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out"),
                     engine={"factory": "tests.driver.secret_engine:make_login_engine", "factory_options": OPTIONS},
                     cluster={"num_workers": 1}, output={"max_error_rate": 1.0, "keep_columns": []})
    data["name"] = "secret-adv"
    data["input"]["rows_per_shard"] = 3
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _leaks(place_to_text: dict[str, str]) -> list[tuple[str, str]]:
    return [(place, stem) for place, text in place_to_text.items() for stem in STEMS if stem in text]


def test_secret_values_leave_no_trace(tmp_path, monkeypatch):
    monkeypatch.setenv("JR_V47_SECRET", SECRETS["api_key"])
    job = _job(tmp_path)
    run = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert run.exit_code == 0, run.output
    status = CliRunner().invoke(main, ["status", str(tmp_path / "out")])
    out = tmp_path / "out"
    errors = {r["id"]: r["error"] for f in sorted((out / "parts").glob("*.parquet"))
              for r in pq.read_table(f, columns=["id", "error"]).to_pylist()}
    files = {str(p): p.read_text(errors="replace") for p in out.rglob("*") if p.is_file() and p.suffix != ".parquet"}
    assert str(out / "_report" / "report.json") in files
    assert _leaks({"run": run.output, "status": status.output, "errors": json.dumps(errors), **files}) == []
    assert errors["r1"] == errors["r5"] == "login refused for credential *** and ***"
    assert errors["r3"] == f"cannot connect with { {k: '***' for k in sorted(OPTIONS)} }"  # the YAML's order
    manifest = json.loads(files[str(out / "_manifest.json")])
    assert manifest["spec"]["engine"]["factory_options"] == {k: "***" for k in OPTIONS}
    assert manifest["totals"]["error_kinds"]["login refused for credential *** and ***"] == 2
    assert "secret-adv: 2/2 shards committed" in run.output  # a count beside a credential word is kept


def test_a_factory_error_is_raised_redacted(tmp_path, monkeypatch):
    """A factory that fails quoting its options fails the worker's load with the text redacted (what Ray logs
    and hands the driver), its traceback kept as a note, redacted too."""
    from jobrunner.driver.actor import _build_engine_redacted
    from jobrunner.driver.engine_factory import build_engine
    from jobrunner.redaction import remember_secrets

    data = fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out"),
                     engine={"factory": "tests.driver.secret_engine:make_login_engine",
                             "factory_options": {**OPTIONS, "api_key": SECRETS["api_key"], "fail_load": True}})
    spec = spec_from_dict(data)
    remember_secrets(spec.secret_values())  # what run_job does in the driver, and the actor with its values
    with pytest.raises(RuntimeError) as info:
        _build_engine_redacted(lambda: build_engine(spec))
    text = f"{info.value}\n{''.join(info.value.__notes__)}"
    assert _leaks({"error": text}) == []
    assert str(info.value).startswith("login refused for credential ***; options {'api_key': '***'")
    assert "make_login_engine" in text  # the factory's frame is in the note
