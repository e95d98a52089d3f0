"""`jobrunner submit --follow` and `jobrunner jobs list|status|logs|stop` against a real Ray head with token
authentication (RAY_AUTH_MODE=token, the head of test_submit_head.py), through Ray's Job Submission API."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from jobrunner.cli import main
from tests.driver.helpers import fake_spec, write_prompts
from tests.driver.test_submit_head import token_head  # noqa: F401 - the fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def _job_file(tmp_path, name: str, rows: int, **sections) -> str:
    write_prompts(tmp_path / f"{name}.parquet", rows)
    spec = fake_spec(str(tmp_path / f"{name}.parquet"), str(tmp_path / f"out-{name}"), **sections)
    spec["name"] = name
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_follow_list_status_logs_and_stop(token_head, tmp_path, monkeypatch):  # noqa: F811
    url, token, _ = token_head
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)  # like `ray start` users: the token from the environment
    auth = ["--address", url]

    code, out = _cli("submit", _job_file(tmp_path, "ok-job", 16, cluster={"num_workers": 1}), *auth, "--follow")
    assert code == 0, out
    ok_id = out.splitlines()[0]
    assert "2/2 shards committed" in out  # 16 rows, 8 per shard
    assert out.rstrip().endswith(f"Ray job {ok_id} ended: SUCCEEDED")

    missing = _job_file(tmp_path, "bad-job", 8)
    (tmp_path / "bad-job.parquet").unlink()  # the head cannot read the input: the Ray job fails
    code, out = _cli("submit", missing, *auth, "--follow")
    bad_id = out.splitlines()[0]
    assert code == 1 and f"Ray job {bad_id} ended: FAILED" in out

    slow = _job_file(tmp_path, "slow-job", 64, engine={"factory_options": {"step_delay_s": 0.5}},
                     cluster={"num_workers": 1})
    code, out = _cli("submit", slow, *auth)
    assert code == 0, out
    slow_id = out.strip()
    code, out = _cli("jobs", "stop", slow_id, *auth, "--wait")
    assert code == 0 and f"Ray job {slow_id}: stop requested; status STOPPED" in out, out

    code, out = _cli("jobs", "list", *auth, "--json")
    assert code == 0, out
    listed = {j["job_id"]: j for j in json.loads(out)}
    assert {listed[i]["status"] for i in (ok_id, bad_id, slow_id)} == {"SUCCEEDED", "FAILED", "STOPPED"}
    assert listed[ok_id]["job_name"] == "ok-job" and listed[ok_id]["duration_s"] > 0
    code, out = _cli("jobs", "list", *auth)
    assert code == 0 and any(line.startswith(ok_id) and "SUCCEEDED" in line and "ok-job" in line
                             for line in out.splitlines())

    code, out = _cli("jobs", "status", ok_id, *auth)
    assert code == 0 and "status      SUCCEEDED" in out and "job_name    ok-job" in out
    code, out = _cli("jobs", "status", bad_id, *auth)
    assert code == 1 and "status      FAILED" in out
    code, out = _cli("jobs", "logs", ok_id, *auth)
    assert code == 0 and "shards committed" in out
    code, out = _cli("jobs", "logs", slow_id, *auth, "--follow")
    assert code == 1 and f"Ray job {slow_id} ended: STOPPED" in out
    code, out = _cli("jobs", "status", "raysubmit_nosuchjob", *auth)
    assert code == 1 and "cannot read Ray job raysubmit_nosuchjob" in out
