"""`jobrunner validate | run | submit` through click's CliRunner; submit goes to a Ray head started here."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from jobrunner.cli import main

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.driver.helpers import fake_spec, free_ports, read_manifest_file, write_prompts  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def _job(tmp_path, **sections) -> Path:
    write_prompts(tmp_path / "in.parquet", 24, poison=sections.pop("poison", None))
    data = fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out"), **sections)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_validate_reports_plan_and_errors(tmp_path):
    runner = CliRunner()
    ok = runner.invoke(main, ["validate", str(_job(tmp_path))])
    assert ok.exit_code == 0, ok.output
    assert "24 rows, 3 shard(s)" in ok.output and "required columns present: prompt, id, topic" in ok.output
    bad = runner.invoke(main, ["validate", str(tmp_path / "job.yaml"), "--set", "input.id_column=missing"])
    assert bad.exit_code == 1 and "missing column 'missing' (input.id_column)" in bad.output
    typo = runner.invoke(main, ["validate", str(tmp_path / "job.yaml"), "--set", "cluster.num_wrkers=2"])
    assert typo.exit_code == 1 and "cluster.num_wrkers: unknown field" in typo.output
    assert "output is empty: a new job" in ok.output
    assert not (tmp_path / "out").exists()
    data = yaml.safe_load((tmp_path / "job.yaml").read_text())
    write_prompts(tmp_path / "dup.parquet", 4)
    import pyarrow.parquet as pq

    pq.write_table(pq.read_table(tmp_path / "dup.parquet"), tmp_path / "dup2.parquet")
    data["input"]["url"] = str(tmp_path / "dup*.parquet")
    (tmp_path / "dup.yaml").write_text(yaml.safe_dump(data))
    dup = runner.invoke(main, ["validate", str(tmp_path / "dup.yaml")])  # ids are always checked now
    assert dup.exit_code == 1 and "input.id_column 'id' has duplicate ids: 'p000' at " in dup.output, dup.output
    assert "dup.parquet row 0 and again at " in dup.output and "dup2.parquet row 0; 'p001' at " in dup.output


def test_run_over_error_budget_exits_1_then_overwrite_succeeds(tmp_path):
    job = _job(tmp_path, poison=3, engine={"factory_options": {"fail_on": "POISON"}},
               cluster={"max_shard_attempts": 2, "num_workers": 1}, output={"max_error_rate": 0.02})
    runner = CliRunner()
    first = runner.invoke(main, ["run", str(job), "--no-progress"])
    manifest = read_manifest_file(tmp_path / "out")
    assert first.exit_code == 1 and manifest["totals"]["shards_committed"] == 3
    assert "1 error row (4.2% of rows)" in first.output
    assert ("4.2% of rows are errors (output.max_error_rate=0.02); top errors: engine crashed on this row: "
            "RuntimeError: fake engine failure (1)") in first.output
    assert "higher output.max_error_rate (nothing is recomputed)" in first.output
    assert not (tmp_path / "out" / "_SUCCESS").exists()
    accept = runner.invoke(main, ["run", str(job), "--no-progress", "--set", "output.max_error_rate=0.5"])
    assert accept.exit_code == 0, accept.output  # the way on the message names first: nothing is recomputed
    assert "3 of 3 shards already committed, nothing left to run" in accept.output
    assert (tmp_path / "out" / "_SUCCESS").exists()
    clear = "engine.factory_options.fail_on=null"
    second = runner.invoke(main, ["run", str(job), "--no-progress", "--set", clear, "--set", "output.mode=overwrite"])
    assert second.exit_code == 0, second.output
    assert "3/3 shards committed, rows 24/24 (100%)" in second.output
    assert (tmp_path / "out" / "_SUCCESS").exists()
    assert (tmp_path / "out" / "_report" / "report.json").exists()
    assert (tmp_path / "out" / "_report" / "report.html").exists()


def _refresh_ray_auth_state() -> None:
    """Make this process's Ray re-read RAY_AUTH_MODE / RAY_AUTH_TOKEN (both are cached on first use)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")  # the config first, then the token cache (Ray's own test helper does the same)
    AuthenticationTokenLoader.instance().reset_cache()


@pytest.fixture
def ray_head(monkeypatch):
    """A Ray head with the Job Submission API on 127.0.0.1, token authentication on with a token of its own
    (given to submit as $RAY_AUTH_TOKEN); its jobs can import the fake engine.

    Token mode is set here, not inherited: a local ``ray.init()`` earlier in the session (other tests) turns it
    on for the whole process, so without this the head checked tokens or not depending on test order.

    The head has a temp dir of its own, with its GCS address in ``ray_current_cluster`` there: Ray's job
    supervisor sends a job's driver to the cluster that file names, and without it to any Ray it finds running on
    the machine (CI once saw a submitted job's driver join another test process's cluster and fail its token
    check). ``Cluster`` does not write the file (``ray start --head`` does), and /tmp/ray's is shared.
    """
    import ray
    from ray._private.utils import write_ray_address
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    auth = {name: os.environ.get(name) for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=uuid.uuid4().hex)
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    _refresh_ray_auth_state()
    port, agent_http, agent_grpc, metrics, runtime_env = free_ports(5)
    temp_dir = tempfile.mkdtemp(prefix="jr-head-")  # short: Ray's socket paths must fit in 107 bytes
    try:
        # Every agent port chosen free: Ray's defaults (e.g. the job agent on 52365) are taken by any other Ray
        # on the machine, and then the head never gets a job agent ("No available agent to submit job").
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": port,
            "dashboard_agent_listen_port": agent_http, "metrics_agent_port": agent_grpc,
            "metrics_export_port": metrics, "runtime_env_agent_port": runtime_env, "temp_dir": temp_dir})
        write_ray_address(cluster.address, temp_dir)  # what `ray start --head` writes; Cluster does not
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            cluster.shutdown()
    finally:
        for name, value in auth.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _refresh_ray_auth_state()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_submit_runs_the_job_on_a_ray_head(ray_head, tmp_path):
    job = _job(tmp_path, cluster={"num_workers": 1})
    result = CliRunner().invoke(main, ["submit", str(job), "--address", ray_head, "--wait",
                                       "--set", "name=submitted"])
    assert result.exit_code == 0, result.output
    job_id = result.output.splitlines()[0]
    assert job_id.startswith("raysubmit_")
    assert "3/3 shards committed, rows 24/24 (100%)" in result.output
    manifest = read_manifest_file(tmp_path / "out")
    assert manifest["job_name"] == "submitted" and manifest["totals"]["rows"] == 24
    bad = CliRunner().invoke(main, ["submit", str(job), "--address", ray_head, "--auth-token", "wrong"])
    assert bad.exit_code == 1 and f"cannot submit to {ray_head}" in bad.output


def _jobs_named(address: str, name: str) -> list[str]:
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(address, headers={"Authorization": f"Bearer {os.environ['RAY_AUTH_TOKEN']}"})
    return [job.submission_id for job in client.list_jobs() if (job.metadata or {}).get("jobrunner_job") == name]


def test_submit_survives_a_dashboard_that_drops_requests_and_never_starts_a_job_twice(ray_head, tmp_path,
                                                                                      monkeypatch):
    """CI once failed on `cannot submit to ...: RemoteDisconnected` from a busy head. Dropped requests are sent
    again under the same submission id: whether the head had acted on the first one or not, one job runs."""
    from jobrunner.driver import submit as submit_module
    from tests.cli.dropping_proxy import DroppingProxy, drop_first

    job = _job(tmp_path, cluster={"num_workers": 1})
    # The head acted on the first POST; only its answer was lost. The retry is told "already exists".
    with DroppingProxy(ray_head, drop_first("POST", "/api/jobs/", "after")) as proxy:
        result = CliRunner().invoke(main, ["submit", str(job), "--address", proxy.url, "--wait",
                                           "--set", "name=answer-lost"])
    assert result.exit_code == 0, result.output
    job_id = result.output.splitlines()[0]
    assert [action for method, _, action in proxy.seen if method == "POST"] == ["after", "forward"]
    assert _jobs_named(ray_head, "answer-lost") == [job_id]
    assert "3/3 shards committed, rows 24/24 (100%)" in result.output

    # The first POST never reached the head (nor the first version check): the retry starts the job, once.
    rules = [drop_first("GET", "/api/version", "before"), drop_first("POST", "/api/jobs/", "before", count=2)]
    with DroppingProxy(ray_head, lambda method, path: rules[0](method, path) or rules[1](method, path)) as proxy:
        result = CliRunner().invoke(main, ["submit", str(job), "--address", proxy.url, "--wait",
                                           "--set", "name=never-arrived", "--set", f"output.url={tmp_path / 'out2'}"])
    assert result.exit_code == 0, result.output
    assert [action for method, _, action in proxy.seen if method == "POST"] == ["before", "before", "forward"]
    assert ("GET", "/api/version", "before") in proxy.seen
    assert _jobs_named(ray_head, "never-arrived") == [result.output.splitlines()[0]]

    # A dashboard that drops every submission: a clear error after the retry window, and no job.
    monkeypatch.setattr(submit_module, "DROPPED_WAIT_S", 3.0)
    with DroppingProxy(ray_head, drop_first("POST", "/api/jobs/", "before", count=10**6)) as proxy:
        result = CliRunner().invoke(main, ["submit", str(job), "--address", proxy.url, "--set", "name=dropped"])
    assert result.exit_code == 1
    assert f"cannot submit to {proxy.url} (it dropped every request for 3 s" in result.output
    assert _jobs_named(ray_head, "dropped") == []

    # Following a job whose dashboard goes silent: an error that says the job may still run, not a hang.
    with DroppingProxy(ray_head, drop_first("GET", f"/api/jobs/{job_id}", "before", count=10**6)) as proxy:
        proxy.rule = (lambda rule: lambda method, path: None if len(proxy.seen) < 3 else rule(method, path))(
            proxy.rule)  # the version check and the first status read pass; then silence
        result = CliRunner().invoke(main, ["jobs", "logs", job_id, "--follow", "--address", proxy.url])
    assert result.exit_code == 1, result.output
    assert f"lost contact with {proxy.url} while following Ray job {job_id} (no answer for 3 s)" in result.output
    assert f"jobrunner jobs status {job_id} --address {proxy.url}" in result.output
