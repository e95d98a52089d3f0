"""`jobrunner submit` against a real head started as a new user would: `.venv/bin/ray start --head` with the
venv not activated (no `jobrunner` on the head's PATH), token authentication on, free ports. The spec's
secret is a ${env:NAME} reference: it never appears in the Ray job's runtime_env, and resolves on the head."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from jobrunner.cli import main
from tests.driver.helpers import fake_spec, free_ports, read_manifest_file, write_prompts

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SECRET = "s3cr3t-" + uuid.uuid4().hex[:8]


def _wait_for_dashboard(url: str, token: str, head: subprocess.Popen, deadline_s: float, log: Path) -> None:
    from ray.job_submission import JobSubmissionClient

    deadline = time.monotonic() + deadline_s
    while True:
        try:
            JobSubmissionClient(url, headers={"Authorization": f"Bearer {token}"}).list_jobs()
            return
        except Exception:  # noqa: BLE001 - not up yet
            if head.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text()[-3000:]
                raise RuntimeError(f"Ray head did not come up at {url}:\n{tail}") from None
            time.sleep(1.0)


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _start_head(tmp_path: Path, attempt: int) -> tuple[subprocess.Popen, str, str, str, int]:
    """`<venv>/bin/ray start --head --block` with RAY_AUTH_MODE=token on free ports; PATH without the venv.
    Returns (process, url, token, temp dir, the job agent's HTTP port)."""
    gcs, dashboard, client, agent_grpc, agent_http, metrics, runtime_env = free_ports(7)
    token = uuid.uuid4().hex + uuid.uuid4().hex
    home = tmp_path / f"home{attempt}"
    home.mkdir()
    temp_dir = tempfile.mkdtemp(prefix="jr-head-")  # short: Ray's socket paths must fit in 107 bytes
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "PYTHONPATH": str(REPO),
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "JR_HEAD_SECRET": SECRET,
           "RAY_USAGE_STATS_ENABLED": "0"}
    command = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
               "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-cpus=2", "--include-dashboard=true",
               "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}",
               f"--dashboard-agent-grpc-port={agent_grpc}", f"--dashboard-agent-listen-port={agent_http}",
               f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={runtime_env}",
               f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    head = subprocess.Popen(command, env=env, cwd=tmp_path, start_new_session=True,
                            stdout=open(tmp_path / "head.log", "w"), stderr=subprocess.STDOUT)
    return head, f"http://127.0.0.1:{dashboard}", token, temp_dir, agent_http


def _agent_log(temp_dir: str) -> str:
    logs = sorted(Path(temp_dir).glob("session_*/logs/dashboard_agent*"))
    return "\n".join(f"--- {f.name}:\n{f.read_text(errors='replace')[-2000:]}" for f in logs) or "(no agent log)"


@pytest.fixture
def token_head(tmp_path):
    """A token-auth head whose job agent is up. Its fixed ports are chosen free but not held: a port another
    process (a Ray of the test beside, under xdist) takes meanwhile kills the agent, so a head whose agent is
    not listening after 90 s is stopped and started once more on fresh ports; a second failure shows the
    agent's log."""
    failures = []
    for attempt in range(2):
        head, url, token, temp_dir, agent_port = _start_head(tmp_path, attempt)
        try:
            _wait_for_dashboard(url, token, head, deadline_s=120, log=tmp_path / "head.log")
            deadline = time.monotonic() + 90
            while not _port_open(agent_port) and time.monotonic() < deadline and head.poll() is None:
                time.sleep(1.0)
            if _port_open(agent_port):
                yield url, token, temp_dir
                return
            failures.append(f"attempt {attempt}: the job agent never listened on {agent_port}\n"
                            f"{_agent_log(temp_dir)}")
        finally:
            _stop(head)
            shutil.rmtree(temp_dir, ignore_errors=True)
    pytest.fail("the Ray head's job agent did not come up:\n" + "\n".join(failures))


def _stop(head: subprocess.Popen) -> None:
    """SIGTERM to the head's own process group (its raylet, GCS, dashboard), then SIGKILL after 5 s (a
    `ray start --block` head often takes 30 s to exit on SIGTERM: that was a minute of the suite)."""
    for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(head.pid, sig)
        except ProcessLookupError:
            return
        try:
            head.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def test_submit_on_a_token_head_without_jobrunner_on_path(token_head, tmp_path, monkeypatch):
    url, token, head_temp_dir = token_head
    write_prompts(tmp_path / "in.parquet", 16)
    spec = fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out"), cluster={"num_workers": 1})
    spec["output"]["storage_options"] = {"api_token": "${env:JR_HEAD_SECRET}"}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    monkeypatch.delenv("JR_HEAD_SECRET", raising=False)  # only the head has it
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)

    result = CliRunner().invoke(main, ["submit", str(tmp_path / "job.yaml"), "--address", url, "--wait",
                                       "--auth-token", token])
    assert result.exit_code == 0, result.output
    assert "2/2 shards committed, rows 16/16 (100%)" in result.output
    import ray._raylet  # the entrypoint ran the head's own Ray Python, found without PATH

    assert f"running with {Path(ray._raylet.__file__).resolve().parents[4]}/bin/python" in result.output
    job_id = result.output.splitlines()[0]

    from ray.job_submission import JobSubmissionClient

    info = JobSubmissionClient(url, headers={"Authorization": f"Bearer {token}"}).get_job_info(job_id)
    shipped = json.dumps(info.runtime_env) + info.entrypoint
    assert SECRET not in shipped and "${env:JR_HEAD_SECRET}" in shipped
    manifest = read_manifest_file(tmp_path / "out")
    assert manifest["spec"]["output"]["storage_options"] == {"api_token": "***"}
    # the resolved secret is nowhere: not in any file under the output, the Ray job's logs, any file of the
    # head's Ray session (driver, worker, raylet, GCS, dashboard and job logs) or what submit printed
    job_logs = JobSubmissionClient(url, headers={"Authorization": f"Bearer {token}"}).get_job_logs(job_id)
    assert "2/2 shards committed" in job_logs and SECRET not in job_logs and SECRET not in result.output
    session_files = [f for f in Path(head_temp_dir).rglob("*") if f.is_file()]
    assert any(f.name.startswith("job-driver-") for f in session_files)  # the job's own log is searched too
    leaks = [str(f) for f in [*session_files, *(tmp_path / "out").rglob("*")]
             if f.is_file() and SECRET.encode() in f.read_bytes()]
    assert leaks == []

    refused = CliRunner().invoke(main, ["submit", str(tmp_path / "job.yaml"), "--address", url,
                                        "--auth-token", "wrong-token"])
    assert refused.exit_code == 1 and f"cannot submit to {url}" in refused.output

    # A job that fails (every row an error): `--wait` follows it to the end and exits 1 with Ray's status.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["", " "], "topic": ["t", "t"]}), tmp_path / "bad.parquet")
    bad = fake_spec(str(tmp_path / "bad.parquet"), str(tmp_path / "bad-out"), cluster={"num_workers": 1})
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    failed = CliRunner().invoke(main, ["submit", str(tmp_path / "bad.yaml"), "--address", url, "--wait",
                                       "--auth-token", token])
    bad_id = failed.output.splitlines()[0]
    assert failed.exit_code == 1, failed.output
    assert f"Ray job {bad_id} ended with status FAILED" in failed.output
    assert "100.0% of rows are errors" in failed.output  # the driver's own reason, followed from the logs
