"""Watching a job while it runs: Prometheus series through Ray's metrics export port, and `jobrunner status` on a
running and a finished output (local disk and a real S3 server), on a real local Ray with the slow fake engine.

Set JOBRUNNER_WATCH_ARTIFACTS=DIR to keep the scrape and the status texts (the issue's closing note)."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from jobrunner.cli import main
from jobrunner.driver.job import run_job
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import fake_spec, new_bucket, write_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SLOW = {"factory_options": {"step_delay_s": 0.08}}
WORKER_SERIES = ("jobrunner_rows_done", "jobrunner_prompt_tokens", "jobrunner_output_tokens",
                 "jobrunner_output_tokens_per_s", "jobrunner_queue_depth", "jobrunner_kv_cache_usage",
                 "jobrunner_prefix_cache_hit_rate")
JOB_SERIES = ("jobrunner_job_rows_done", "jobrunner_job_rows_planned", "jobrunner_job_workers",
              "jobrunner_job_output_tokens_per_s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def metrics_ray():
    """A local Ray whose node exports Prometheus metrics on a free port of 127.0.0.1; yields the scrape URL."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    port = _free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             _node_ip_address="127.0.0.1", _metrics_export_port=port,
             _system_config={"metrics_report_interval_ms": 1000})
    yield f"http://127.0.0.1:{port}/metrics"
    ray.shutdown()


def _scrape(url: str) -> dict[tuple[str, str], float]:
    """(series name, Worker tag or '') -> value, for the jobrunner series of one Prometheus text page."""
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        match = re.match(r"^ray_(jobrunner_\w+?)(?:_total)?\{([^}]*)\} ([0-9.eE+-]+)$", line)
        if match and 'JobName="watch-job"' in match.group(2):
            worker = re.search(r'(?:^|,)Worker="([^"]*)"', match.group(2))
            found[(match.group(1), worker.group(1) if worker else "")] = float(match.group(3))
    return found


def _start_job(spec: dict) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        box["result"] = run_job(spec_from_dict(spec), show_progress=False)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def _status(url: str, *extra: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["status", url, *extra])
    return result.exit_code, result.output


def _keep(name: str, text: str) -> None:
    folder = os.environ.get("JOBRUNNER_WATCH_ARTIFACTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / name).write_text(text)


def test_metrics_and_status_while_a_job_runs(metrics_ray, tmp_path):
    write_prompts(tmp_path / "in.parquet", 64)
    out = str(tmp_path / "out")
    # known gauges: 3 of 8 KV blocks in use; the first of each prompt's 4 words a prefix-cache hit
    # and the engine waits after its first finished rows until `go` exists: the job stays mid-run until seen
    hold = tmp_path / "go"
    engine = {"factory_options": {**SLOW["factory_options"], "kv_blocks": [3, 8], "cached_prompt_tokens": 1,
                                  "hold_file": str(hold)}}
    spec = fake_spec(str(tmp_path / "in.parquet"), out, engine=engine, sampling={"max_tokens": 24},
                     output={"lease_ttl_s": 6})  # a heartbeat (with the driver's live counts) every second
    spec["name"] = "watch-job"
    thread, box = _start_job(spec)
    seen: dict = {}
    running_status = None
    deadline = time.monotonic() + 240  # generous: Ray's metrics agent reports every second or so
    while thread.is_alive() and time.monotonic() < deadline:
        scrape = _scrape(metrics_ray)
        if all(any(k[0] == s and v > 0 for k, v in scrape.items()) for s in ("jobrunner_rows_done",
                                                                             "jobrunner_job_rows_done")):
            seen = scrape
        if running_status is None:
            code, text = _status(out, "--json")
            now = json.loads(text) if code == 0 else {}
            if now.get("state") == "running" and now.get("live") and now["rows"]["done"] > 0:
                running_status = (json.loads(text), _status(out)[1])
        if seen and running_status and set(k[0] for k in seen) >= set(WORKER_SERIES + JOB_SERIES):
            break
        time.sleep(0.5)
    hold.touch()
    thread.join(timeout=240)
    assert box["result"].ok

    names = {k[0] for k in seen}
    assert names >= set(WORKER_SERIES + JOB_SERIES), sorted(names)
    workers = {k[1] for k in seen if k[0] == "jobrunner_rows_done"}
    assert workers and workers <= {"w0", "w1"}
    assert seen[("jobrunner_job_rows_planned", "")] == 64
    assert 0 < seen[("jobrunner_job_rows_done", "")] <= 64
    assert all(seen[("jobrunner_prompt_tokens", w)] > 0 for w in workers)
    assert seen[("jobrunner_job_workers", "")] >= 1
    assert {w: seen[("jobrunner_kv_cache_usage", w)] for w in workers} == {w: 3 / 8 for w in workers}
    # "question {i} about things": 1 of 4 prompt tokens cached on every worker that has finished a row
    assert {w: seen[("jobrunner_prefix_cache_hit_rate", w)] for w in workers} == {w: 0.25 for w in workers}
    _keep("metrics_scrape.txt", "\n".join(f"{n}{{Worker={w!r}}} {v}" for (n, w), v in sorted(seen.items())))

    assert running_status is not None, "status never saw the job running with a committed row"
    status, text = running_status
    assert status["lease"]["run_id"] and status["lease"]["heartbeat_age_s"] is not None
    assert not status["lease"]["expired"] and status["rows"]["total"] == 64
    assert 0 < status["rows"]["done"] < 64 and status["speed"]["basis"] == "this run so far (the driver's count)"
    assert status["live"]["phase"] == "running" and status["live"]["rows_total"] == 64
    assert status["workers"]["count"] >= 1 and status["workers"]["live"] >= 1
    assert "state    running" in text and "lease    run " in text and "last heartbeat" in text
    _keep("status_running.txt", text)

    code, text = _status(out)
    assert code == 0, text
    assert "complete (_SUCCESS written)" in text and "done     rows 64/64 (100%)\n" in text
    assert "errors   0 error rows (0.0% of the rows written)" in text
    assert "lease    none" in text and "ETA      done" in text
    _keep("status_finished.txt", text)
    final = json.loads(_status(out, "--json")[1])
    assert final["tokens"]["output"] == 64 * 24 and final["speed"]["tokens_per_s"] > 0
    assert final["speed"]["tokens_kind"] == "out" and final["counts"]["prompts_done"] == 64


def test_status_on_object_storage_running_and_finished(metrics_ray, s3_server, tmp_path):
    opts = s3_server["storage_options"]
    bucket = new_bucket(s3_server)
    write_prompts(f"s3://{bucket}/in.parquet", 32, storage_options=opts)
    out = f"s3://{bucket}/out"
    hold = tmp_path / "go"  # the engine waits after its first finished rows until this exists: no race with status
    engine = {"factory_options": {**SLOW["factory_options"], "hold_file": str(hold)}}
    spec = fake_spec(f"s3://{bucket}/in.parquet", out, storage_options=opts, engine=engine,
                     sampling={"max_tokens": 16}, cluster={"num_workers": 1})
    thread, box = _start_job(spec)
    flag = ["--storage-options", json.dumps(opts)]
    running = None
    deadline = time.monotonic() + 180
    while thread.is_alive() and running is None and time.monotonic() < deadline:
        code, text = _status(out, "--json", *flag)
        if code == 0 and json.loads(text)["state"] == "running" and json.loads(text)["rows"]["done"] > 0:
            running = json.loads(text)
        time.sleep(0.3)
    hold.touch()
    thread.join(timeout=240)
    assert box["result"].ok
    assert running is not None and running["lease"]["host"] == socket.gethostname()
    assert 0 < running["rows"]["done"] < 32 and running["workers"]["count"] == running["workers"]["live"] == 1
    code, text = _status(out, "--json", *flag)
    assert code == 0 and json.loads(text)["workers"]["ids"] == ["w0"], text
    code, text = _status(out, *flag)
    assert code == 0 and "rows 32/32 (100%)" in text and "complete" in text, text


def test_status_names_what_is_missing(tmp_path):
    code, text = _status(str(tmp_path / "nothing"))
    assert code == 1 and "no _manifest.json and no _lease.json" in text and "nothing" in text
