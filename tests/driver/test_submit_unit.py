"""Submission pieces that need no cluster: where the auth token comes from, what is submitted."""

from __future__ import annotations

import json

from jobrunner.driver.submit import SPEC_ENV, build_submission, find_auth_token
from jobrunner.spec import load_spec


def test_auth_token_sources_in_order(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    assert find_auth_token() is None
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("from-home\n")
    assert find_auth_token() == "from-home"
    (tmp_path / "tok").write_text("from-path")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "tok"))
    assert find_auth_token() == "from-path"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert find_auth_token() == "from-env"
    assert find_auth_token("explicit") == "explicit"


def test_submission_carries_the_spec_in_runtime_env():
    spec = load_spec("jobs/example.yaml", ["sampling.max_tokens=5"])
    sub = build_submission(spec, working_dir="/tmp/x")
    assert sub["entrypoint"] == f"jobrunner run env:{SPEC_ENV}"
    assert json.loads(sub["runtime_env"]["env_vars"][SPEC_ENV])["sampling"]["max_tokens"] == 5
    assert sub["runtime_env"]["working_dir"] == "/tmp/x"
