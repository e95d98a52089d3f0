"""What a person sees while a pipeline runs (issue 48 walkthrough): a line per stage as it starts / resumes and
ends (with its funnel), a periodic line of all stages, the hint a Ctrl-C ends on, and `jobrunner status` on a
stage that waits for the previous one. The fake engine; two stages on 16 rows."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import yaml
from click.testing import CliRunner

from jobrunner.cli.job import interrupt_hint
from jobrunner.cli.status import render_status, status
from jobrunner.driver.pipeline import run_pipeline
from jobrunner.driver.pipeline_view import FunnelTally, PipelineView
from jobrunner.driver.progress import Progress
from jobrunner.driver.stage_feed import StageHooks
from jobrunner.io.manifest import read_manifest_with_records
from jobrunner.io.storage import Storage
from jobrunner.progress_view import Counts
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import REPO

pytestmark = pytest.mark.timeout(300)
N = 16


def _input(path: Path) -> str:
    pq.write_table(pa.table({"id": [f"r{i:02d}" for i in range(N)], "prompt": [f"question {i}" for i in range(N)],
                             "topic": [f"t{i % 3}" for i in range(N)]}), path, row_group_size=4)
    return str(path)


def _spec(input_url: str, output_url: str, step_delay_s: float = 0.0, mode: str = "resume") -> dict:
    return {"name": "console", "input": {"url": input_url, "prompt_column": "prompt", "id_column": "id",
                                         "rows_per_shard": 4},
            "sampling": {"max_tokens": 4},
            "engine": {"max_num_seqs": 4, "factory": "tests.driver.fake_engine:make_engine",
                       "factory_options": {"step_delay_s": step_delay_s}},
            "cluster": {"num_workers": 1, "num_cpus_per_worker": 0.5, "retry_backoff_s": 0.1},
            "output": {"url": output_url, "mode": mode},
            "stages": [{"name": "generate", "filter": "topic != 't2'"},
                       {"name": "judge", "input": {"prompt": "Judge: {prompt} -> {generated_text}"}}]}


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("[jobrunner]")]


def test_pipeline_run_prints_each_stage_start_and_end_with_its_funnel(local_ray, tmp_path, capsys):
    spec = spec_from_dict(_spec(_input(tmp_path / "in.parquet"), str(tmp_path / "out")))
    result = run_pipeline(spec, address=ray.get_runtime_context().gcs_address)
    assert result.ok
    lines = _lines(capsys.readouterr().err)
    # 16 rows, topics t0 t1 t2 ...: the 5 rows of t2 are dropped by the generate stage's filter
    assert "[jobrunner] stage generate started: rows 0/16 to do" in lines
    assert "[jobrunner] stage judge started: waits for stage generate's committed rows" in lines
    ends = [line.split(" | elapsed ")[0] for line in lines if " done: " in line]
    assert ends == ["[jobrunner] stage generate done: rows 16/16 (100%) | 16 in -> 11 kept, 5 dropped by filter, "
                    "0 error row(s)",
                    "[jobrunner] stage judge done: rows 11/11 (100%) | 11 in -> 11 kept, 0 dropped by filter, "
                    "0 error row(s)"]

    # run again: every stage resumes with what it committed, nothing to do
    result = run_pipeline(spec, address=ray.get_runtime_context().gcs_address)
    lines = _lines(capsys.readouterr().err)
    assert "[jobrunner] stage generate resumes: 16 rows committed by earlier runs are kept, 0 of 16 to do" in lines
    assert "[jobrunner] stage judge resumes: 11 rows committed by earlier runs are kept" in lines


def test_periodic_line_shows_every_stage_and_the_funnel_so_far(tmp_path):
    now = [100.0]
    hooks = [StageHooks(), StageHooks()]
    hooks[0].progress = Progress(Counts(0, 64, 0, 64), enabled=False, clock=lambda: now[0], started_s=90.0)
    out = io.StringIO()
    view = PipelineView(["generate", "judge"], hooks, [], FunnelTally(Storage(str(tmp_path)), ["generate", "judge"]),
                        file=out, interval_s=10.0, clock=lambda: now[0], started_s=90.0)
    view.poll({})
    hooks[0].progress.update(Counts(40, 64, 40, 64), tokens=160)
    now[0] = 125.0
    view.poll({})
    assert out.getvalue().splitlines() == [
        "[jobrunner] stage generate started: rows 0/64 to do",
        "[jobrunner] pipeline | generate rows 40/64 (62%), 0 kept, 0 dropped, 0 error row(s) | judge waiting for "
        "generate | elapsed 35s"]


def test_ctrl_c_of_a_pipeline_says_the_committed_rows_are_kept_and_how_to_resume(local_ray, tmp_path):
    out = tmp_path / "out"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(_spec(_input(tmp_path / "in.parquet"), str(out), 0.3)))
    cmd = [sys.executable, "-c", "from jobrunner.cli import main; main()", "run", str(tmp_path / "job.yaml"),
           "--address", ray.get_runtime_context().gcs_address, "--no-report"]
    # Ctrl-C as a terminal delivers it, even where the suite itself was started in the background by a shell
    # without job control (which leaves SIGINT ignored, inherited by every child: the driver would run on)
    driver = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=_sigint_default)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not _committed(out / "stages/generate"):
        time.sleep(0.05)
    os.kill(driver.pid, signal.SIGINT)
    _, err = driver.communicate(timeout=120)
    assert driver.returncode == 1  # click's "Aborted!", as before
    assert f"interrupted: the rows committed so far are kept under {out}; run the same command again to resume " \
           "(committed rows are not redone)" in err
    assert "[jobrunner] stage generate stopped (interrupted): rows " in err, err
    assert "[jobrunner] stage judge stopped (interrupted): " in err, err
    assert err.rstrip().endswith("Aborted!")
    judge = CliRunner().invoke(status, [str(out)]).output.split("[stage judge]")[1]
    if "stage judge stopped (interrupted): no row reached it" in err:  # SIGINT before the judge had a shard
        assert "done    nothing yet: waits for stage generate's committed rows (none handed on so far)" in judge
        assert "ETA     n/a (starts once stage generate commits a shard" in judge
    else:
        assert "waits for stage" not in judge


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _committed(folder: Path) -> bool:
    try:
        manifest = read_manifest_with_records(Storage(str(folder))) or {}
    except (OSError, ValueError):
        return False
    return any(e["status"] == "committed" for e in (manifest.get("shards") or {}).values())


def test_interrupt_hint_names_what_the_mode_does_on_a_rerun(tmp_path):
    base = _spec(str(tmp_path / "in.parquet"), "/data/out")
    hint = {mode: interrupt_hint(spec_from_dict({**base, "output": {"url": "/data/out", "mode": mode}}))
            for mode in ("resume", "overwrite", "error")}
    assert hint["resume"] == ("interrupted: the rows committed so far are kept under /data/out; run the same "
                              "command again to resume (committed rows are not redone)")
    assert hint["overwrite"] == ("interrupted: the rows committed so far are kept under /data/out; with "
                                 "output.mode overwrite the same command starts over: add --set "
                                 "output.mode=resume to resume")
    assert "output.mode error the same command refuses the existing output" in hint["error"]


def test_status_of_a_stage_without_shards_says_what_it_waits_for():
    report = {"url": "/out/stages/judge", "state": "running", "phase": None, "started_at": "2026-12-06T07:00:00Z",
              "run_count": 1, "finished_at": None, "lease": None, "counts": {"prompts_done": 0, "prompts_total": 0,
                                                                              "samples_done": 0, "samples_total": 0}}
    text = render_status(report, waits_for="generate")
    assert text.splitlines()[2:4] == [
        "done    nothing yet: waits for stage generate's committed rows (none handed on so far)",
        "ETA     n/a (starts once stage generate commits a shard with rows that pass its filter)"]
    assert "any moment" not in text and "planning" not in text


def test_status_of_a_finished_pipeline_lists_its_stages(local_ray, tmp_path):
    spec = spec_from_dict(_spec(_input(tmp_path / "in.parquet"), str(tmp_path / "out")))
    assert run_pipeline(spec, address=ray.get_runtime_context().gcs_address, show_progress=False).ok
    result = CliRunner().invoke(status, [str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "waits for stage" not in result.output  # every stage has its rows
    assert "funnel: generate 16 in -> 11 kept (5 dropped by filter, 0 error row(s))" in result.output
