"""Submission pieces that need no cluster: where the auth token comes from, what is submitted."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jobrunner.driver.submit import (
    NOT_FOUND,
    PYTHON_ENV,
    SPEC_ENV,
    SubmitError,
    build_submission,
    entrypoint,
    find_auth_token,
)
from jobrunner.redaction import find_secrets
from jobrunner.spec import load_spec

REPO = Path(__file__).resolve().parents[2]


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


def test_submission_carries_the_spec_as_written_in_runtime_env():
    spec = load_spec("jobs/example.yaml", ["sampling.max_tokens=5"])
    sub = build_submission(spec, working_dir="/tmp/x")
    assert sub["entrypoint"] == entrypoint()
    assert json.loads(sub["runtime_env"]["env_vars"][SPEC_ENV])["sampling"]["max_tokens"] == 5
    assert sub["runtime_env"]["working_dir"] == "/tmp/x"
    assert PYTHON_ENV not in sub["runtime_env"]["env_vars"]
    assert build_submission(spec, python="/opt/py")["runtime_env"]["env_vars"][PYTHON_ENV] == "/opt/py"


def test_submission_refuses_plain_text_secrets_and_ships_env_refs(tmp_path):
    data = {"name": "s", "input": {"url": "s3://u:pw@host/in", "prompt_column": "p",
                                   "storage_options": {"key": "AKIA", "secret": "${env:JR_SECRET}"}},
            "engine": {"factory": "m:f", "factory_options": {"api_key": "sk-1"}}, "output": {"url": "o"}}
    with pytest.raises(SubmitError) as info:
        build_submission(data)
    assert "(input.url, input.storage_options.key, engine.factory_options.api_key)" in str(info.value)
    assert "sk-1" not in str(info.value) and "AKIA" not in str(info.value)
    data["input"]["url"] = "s3://u:${env:JR_PW}@host/in"
    data["input"]["storage_options"]["key"] = "${env:JR_KEY}"
    data["engine"]["factory_options"]["api_key"] = "${env:JR_API_KEY}"
    shipped = build_submission(data)["runtime_env"]
    assert json.loads(shipped["env_vars"][SPEC_ENV]) == data
    assert "JR_SECRET" in json.dumps(shipped) and find_secrets(shipped) == []


def _run_entrypoint(tmp_path, parent: list[str], env: dict) -> subprocess.CompletedProcess:
    """The entrypoint through /bin/sh as Ray runs it (a child of `parent`, as of the job supervisor), with
    `run` swapped for `--version`; PATH holds only sed, head and readlink (no python, no jobrunner)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("sed", "head", "readlink"):
        if not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(shutil.which(tool))
    command = entrypoint(submitter_python=str(tmp_path / "missing-python")).replace(
        f"run env:{SPEC_ENV}", "--version")
    env = {"PATH": str(bin_dir), "PYTHONPATH": str(REPO), **env}
    return subprocess.run([*parent, command], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)


def test_entrypoint_finds_a_python_with_jobrunner_without_path(tmp_path):
    shell_parent = ["/bin/sh", "-c", '/bin/sh -c "$0"; exit $?']  # a parent that is not Python
    missing = _run_entrypoint(tmp_path, shell_parent, {})
    assert missing.returncode == 127 and missing.stderr.strip() == NOT_FOUND
    explicit = _run_entrypoint(tmp_path, shell_parent, {PYTHON_ENV: sys.executable})
    assert explicit.returncode == 0 and "jobrunner.cli, version" in explicit.stdout
    assert f"jobrunner submit: running with {sys.executable}" in explicit.stderr
    # Under Ray the parent is the job supervisor, a Ray worker (ray imported) of the head's Python: found
    # through the site-packages its ray/_raylet.so was loaded from.
    import ray._raylet

    ray_prefix = Path(ray._raylet.__file__).resolve().parents[4]
    python_parent = [sys.executable, "-c", "import ray._raylet, subprocess, sys; "
                     "sys.exit(subprocess.run(['/bin/sh', '-c', sys.argv[1]]).returncode)"]
    supervisor = _run_entrypoint(tmp_path, python_parent, {})
    assert supervisor.returncode == 0 and "jobrunner.cli, version" in supervisor.stdout
    assert f"jobrunner submit: running with {ray_prefix}/bin/python" in supervisor.stderr


def test_cli_submit_refuses_a_plain_text_secret_before_contacting_the_cluster(tmp_path):
    from click.testing import CliRunner

    from jobrunner.cli import main

    job = tmp_path / "job.yaml"
    job.write_text("name: s\ninput: {url: in.parquet, prompt_column: p, storage_options: {secret: hunter2}}\n"
                   "output: {url: out}\n")
    result = CliRunner().invoke(main, ["submit", str(job), "--address", "http://127.0.0.1:9"])
    assert result.exit_code == 1
    assert "the spec holds secrets in plain text (input.storage_options.secret)" in result.output
    assert "hunter2" not in result.output
