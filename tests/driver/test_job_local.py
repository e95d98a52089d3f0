"""Whole jobs on a local Ray with the fake engine: outputs, manifest, resume, S3, failed shards, bad input."""

from __future__ import annotations

import os
import re

import pytest

from jobrunner.driver.job import run_job
from jobrunner.driver.output import OutputError
from jobrunner.io.parts import read_output
from jobrunner.io.reader import InputError
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import fake_spec, new_bucket, read_manifest_file, write_prompts

pytestmark = pytest.mark.timeout(600)


def _ids(url, opts=None):
    return sorted(read_output(url, opts).column("id").to_pylist())


def test_job_writes_every_row_once_and_resume_skips_committed(local_ray, tmp_path):
    ids = write_prompts(tmp_path / "in.parquet", 40)
    out = tmp_path / "out"
    spec = spec_from_dict(fake_spec(str(tmp_path / "in.parquet"), str(out)))
    result = run_job(spec, show_progress=False)
    assert result.ok and _ids(str(out)) == ids
    manifest = read_manifest_file(out)
    assert manifest["totals"]["rows"] == 40 and manifest["totals"]["shards_committed"] == 5
    assert manifest["totals"]["num_output_tokens"] == 160
    assert {e["status"] for e in manifest["shards"].values()} == {"committed"}
    workers = manifest["workers"]
    # a worker still starting when the job ended is paid for its start-up (estimated), never alive
    assert set(workers) <= {"w0", "w1"} and all(w["alive_s"] > 0 or w.get("estimated") for w in workers.values())
    assert sum(w.get("steps", 0) for w in workers.values()) > 0  # a worker ready late may have had no shard left
    # not Ray's 15 (cluster.worker_niceness); a worker still starting when the job ended has no process facts
    assert all(w["niceness"] == 0 for w in workers.values() if not w.get("estimated"))
    # Worker-seconds count actor start + model load (startup_s), shown on their own line in reports.
    startup = sum(w["startup_s"] for w in workers.values())
    assert all(w["startup_s"] > 0 for w in workers.values())
    assert manifest["totals"]["startup_seconds"] == round(startup, 3)
    assert manifest["totals"]["worker_seconds"] == round(sum(w["alive_s"] for w in workers.values()) + startup, 3)
    from jobrunner.reports import load_report
    from jobrunner.reports.text import render_text

    report = load_report(str(out), worker_hour_usd=3.6)
    assert report["time"]["startup_seconds"] == manifest["totals"]["startup_seconds"]
    assert report["cost"]["startup_usd"] == pytest.approx(startup * 3.6 / 3600)
    assert "of which start-up (actor start + model load)" in render_text([report])
    # where the start-up went (a custom engine's build is one `load` stage), and what the driver saw
    # (a worker still starting when the job ended has only the driver's estimate: no stages, maybe not ready)
    started = {k: w for k, w in workers.items() if "startup_stages_s" in w}
    assert started and all(w.get("estimated") for k, w in workers.items() if k not in started)
    for w in started.values():
        assert list(w["startup_stages_s"]) == ["process", "wait", "load"]
        if not w.get("estimated"):
            assert abs(sum(w["startup_stages_s"].values()) - w["startup_s"]) < 0.05
    seen = manifest["runs"][-1]["startup"]
    assert set(started) <= set(seen["workers"]) <= set(workers) and seen["plan_s"] > 0
    ready = [s for s in seen["workers"].values() if "ready_s" in s]
    assert len(ready) >= len(started) and all(0 < s["placed_s"] <= s["ready_s"] for s in ready)
    assert report["time"]["first_ready_s"] == min(s["ready_s"] for s in ready)
    assert "last run: first worker ready after" in render_text([report])
    assert manifest["model"]["architecture"] == "FakeForTests"
    assert (out / "_SUCCESS").exists() and not any((out / "_temporary").glob("**/*.parquet"))
    table = read_output(str(out))
    assert set(table.column("topic").to_pylist()) == {"t0", "t1", "t2"}
    assert set(table.column("worker_id").to_pylist()) <= {"w0", "w1"}

    # Lose one committed part and mark another shard pending: resume redoes exactly those two.
    shard_ids = sorted(manifest["shards"])
    os.remove(out / manifest["shards"][shard_ids[0]]["part"])
    mtimes = {p.name: p.stat().st_mtime_ns for p in (out / "parts").iterdir()}
    manifest["shards"][shard_ids[1]]["status"] = "pending"
    (out / "_manifest.json").write_text(__import__("json").dumps(manifest))
    result = run_job(spec, show_progress=False)
    assert result.ok and _ids(str(out)) == ids
    after = read_manifest_file(out)
    redone = {s for s, e in after["shards"].items() if e["worker_id"].startswith("r1")}
    assert redone == {shard_ids[0], shard_ids[1]}
    for name, mtime in mtimes.items():
        if shard_ids[1] not in name:
            assert (out / "parts" / name).stat().st_mtime_ns == mtime, f"{name} was recomputed"
    assert after["run_count"] == 2 and len(after["runs"]) == 2

    # Nothing left to do: a third run starts no worker and changes no part.
    assert run_job(spec, show_progress=False).ok
    assert read_manifest_file(out)["run_count"] == 3


def test_job_on_s3_input_and_output(local_ray, s3_server):
    opts = s3_server["storage_options"]
    bucket = new_bucket(s3_server)
    ids = write_prompts(f"s3://{bucket}/data/in.parquet", 20, storage_options=opts)
    spec = spec_from_dict(fake_spec(f"s3://{bucket}/data/", f"s3://{bucket}/out", opts,
                                    cluster={"num_workers": 1}))
    assert run_job(spec, show_progress=False).ok
    assert _ids(f"s3://{bucket}/out", opts) == ids
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    assert fs.exists(f"{bucket}/out/_SUCCESS")
    manifest = __import__("json").loads(fs.cat_file(f"{bucket}/out/_manifest.json"))
    assert manifest["spec"]["output"]["storage_options"]["secret"] == "***"


def test_poison_row_is_isolated_and_error_budget_decides_the_exit(local_ray, tmp_path):
    ids = write_prompts(tmp_path / "in.parquet", 32, poison=13)
    out = tmp_path / "out"
    spec = spec_from_dict(fake_spec(str(tmp_path / "in.parquet"), str(out),
                                    engine={"factory_options": {"fail_on": "POISON"}},
                                    output={"max_error_rate": 0.01}))
    result = run_job(spec, show_progress=False)
    rows = {r["id"]: r for r in read_output(str(out)).to_pylist()}
    assert sorted(rows) == ids  # every neighbour of the poison row committed, each id once
    assert rows["p013"]["error"] == "engine crashed on this row: RuntimeError: fake engine failure"
    assert all(r["error"] is None for i, r in rows.items() if i != "p013")
    manifest = read_manifest_file(out)
    poisoned = [e for e in manifest["shards"].values() if e["row_start"] == 8][0]
    assert poisoned["status"] == "committed" and len(poisoned["parts"]) == 1 and poisoned["failures"] == 0
    # isolated inside the worker: engine rebuilds, no worker restart, no model load
    cost = manifest["runs"][-1]["isolation"]
    assert cost["engine_rebuilds"] >= 2 and cost["model_loads"] == 0 and cost["rows_isolated"] == 1
    # no worker was replaced: only the two first workers ran (either may have taken every shard before the other
    # was ready: which one is up to placement)
    assert manifest["workers"] and set(manifest["workers"]) <= {"w0", "w1"}
    assert manifest["totals"]["num_errors"] == 1 and manifest["totals"]["shards_failed"] == 0
    # 1 error in 32 rows is above max_error_rate 0.01: the job is not ok, and says why.
    assert not result.ok and not result.failed
    assert "3.1% of rows are errors (output.max_error_rate=0.01)" in result.failure_message()
    assert "engine crashed on this row: RuntimeError: fake engine failure (1)" in result.failure_message()
    assert "1 error row (3.1% of rows)" in result.summary()
    assert not (out / "_SUCCESS").exists()
    assert sorted(p.name for p in (out / "parts").iterdir()) == sorted(
        p.rsplit("/", 1)[-1] for e in manifest["shards"].values() for p in e["parts"])


def test_every_row_an_error_exits_non_zero(local_ray, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["", " "]}), tmp_path / "in.parquet")
    spec = spec_from_dict(fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out"),
                                    output={"keep_columns": [], "max_error_rate": 1.0}))
    result = run_job(spec, show_progress=False)
    assert not result.ok and result.error_rate == 1.0
    assert "100.0% of rows are errors" in result.failure_message()


def test_bad_input_and_output_fail_before_anything_is_written(tmp_path):
    write_prompts(tmp_path / "in.parquet", 4)
    out = tmp_path / "out"
    cases = [
        (fake_spec(str(tmp_path / "in.parquet"), str(out), input={"prompt_column": "text"}),
         InputError, "missing column 'text'"),
        (fake_spec(str(tmp_path / "nope"), str(out)), InputError, "nope.*not found"),
    ]
    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1 garbage")
    cases.append((fake_spec(str(tmp_path / "corrupt.parquet"), str(out)), InputError, "corrupt.parquet"))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": pa.array([], pa.string()), "prompt": pa.array([], pa.string())}),
                   tmp_path / "empty.parquet")
    cases.append((fake_spec(str(tmp_path / "empty.parquet"), str(out), output={"keep_columns": []}),
                  InputError, "no rows"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_prompts(tmp_path / "a" / "x.parquet", 2)
    write_prompts(tmp_path / "b" / "x.parquet", 2)
    cases.append((fake_spec(str(tmp_path / "*/x.parquet"), str(out), input={"id_column": None}),
                  InputError, "same name 'x'.*set input.id_column"))
    for data, error, match in cases:
        with pytest.raises(error, match=match):
            run_job(spec_from_dict(data), show_progress=False)
        assert not out.exists()
    out.mkdir()
    (out / "something.txt").write_text("x")
    with pytest.raises(OutputError, match="already exists"):
        run_job(spec_from_dict(fake_spec(str(tmp_path / "in.parquet"), str(out), output={"mode": "error"})))
    with pytest.raises(OutputError, match="no _manifest.json"):
        run_job(spec_from_dict(fake_spec(str(tmp_path / "in.parquet"), str(out))))


def test_unreachable_output_bucket_is_named(s3_server, tmp_path):
    write_prompts(tmp_path / "in.parquet", 4)
    spec = spec_from_dict(fake_spec(str(tmp_path / "in.parquet"), "s3://no-such-bucket-out/x",
                                    s3_server["storage_options"]))
    spec = spec.model_copy(update={"input": spec.input.model_copy(update={"storage_options": {}})})
    with pytest.raises(OutputError, match="output.url 's3://no-such-bucket-out/x': cannot write there"):
        run_job(spec, show_progress=False)


def test_messages_json_overrides_struct_and_overwrite_mode(local_ray, tmp_path):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    messages = [json.dumps([{"role": "user", "content": f"hello number {i}"}]) for i in range(6)]
    messages[2] = "not json"
    overrides = [{"max_tokens": 2}, None, None, {"max_tokens": 1}, {"max_tokens": 0}, None]
    pq.write_table(pa.table({"messages": messages, "params": overrides}), tmp_path / "chat.parquet")
    data = fake_spec(str(tmp_path / "chat.parquet"), str(tmp_path / "out"),
                     input={"prompt_column": None, "messages_column": "messages", "id_column": None,
                            "sampling_column": "params"},
                     output={"keep_columns": [], "mode": "overwrite"})
    (tmp_path / "out" / "parts").mkdir(parents=True)
    (tmp_path / "out" / "parts" / "part-stale.parquet").write_text("old")
    (tmp_path / "out" / "_manifest.json").write_text('{"job_name": "fake-job"}')  # an earlier run of this job
    data["output"]["max_error_rate"] = 0.5
    assert run_job(spec_from_dict(data), show_progress=False).ok
    assert not (tmp_path / "out" / "parts" / "part-stale.parquet").exists()
    rows = {r["id"]: r for r in read_output(str(tmp_path / "out")).to_pylist()}
    assert sorted(rows) == [f"chat:{i}" for i in range(6)]
    assert [rows[f"chat:{i}"]["num_output_tokens"] for i in (0, 1, 3, 5)] == [2, 4, 1, 4]
    assert "messages column 'messages'" in rows["chat:2"]["error"]
    assert "max_tokens" in rows["chat:4"]["error"] and rows["chat:4"]["finish_reason"] == "error"


def test_overwrite_refuses_foreign_prefixes_the_input_and_bucket_roots(tmp_path, s3_server):
    write_prompts(tmp_path / "data" / "in.parquet", 4)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    cases = [(str(tmp_path / "other"), "holds 1 file \\(notes.txt\\) not written by jobrunner"),
             (str(tmp_path / "data"), "lies inside output.url"),
             (str(tmp_path), "lies inside output.url")]
    for url, match in cases:
        spec = spec_from_dict(fake_spec(str(tmp_path / "data" / "in.parquet"), url, output={"mode": "overwrite"}))
        with pytest.raises(OutputError, match=match):
            run_job(spec, show_progress=False)
    assert (tmp_path / "other" / "notes.txt").read_text() == "keep me" and (tmp_path / "data" / "in.parquet").exists()
    bucket = new_bucket(s3_server)
    spec = spec_from_dict(fake_spec(str(tmp_path / "data" / "in.parquet"), f"s3://{bucket}",
                                    s3_server["storage_options"], output={"mode": "overwrite"}))
    spec = spec.model_copy(update={"input": spec.input.model_copy(update={"storage_options": {}})})
    with pytest.raises(OutputError, match=f"'s3://{bucket}' is a bucket or filesystem root"):
        run_job(spec, show_progress=False)


def test_one_run_per_output_and_a_stalled_lease_is_taken_over(local_ray, tmp_path):
    import json
    import threading
    import time

    ids = write_prompts(tmp_path / "in.parquet", 24)
    out, go = tmp_path / "out", tmp_path / "go"
    # the first run holds after its first row until `go` exists: the second run watches it alive however fast
    # the machine (it once finished before the second run started watching)
    data = fake_spec(str(tmp_path / "in.parquet"), str(out),
                     engine={"factory_options": {"step_delay_s": 0.05, "hold_file": str(go)}},
                     cluster={"num_workers": 1}, output={"lease_ttl_s": 5.0})
    box = {}
    first = threading.Thread(target=lambda: box.update(result=run_job(spec_from_dict(data), show_progress=False)))
    first.start()
    deadline = time.monotonic() + 60
    while not (out / "_lease.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    holder = json.loads((out / "_lease.json").read_text())
    # the second run watches the lease, sees it renewed (the first run is alive) and refuses
    with pytest.raises(OutputError, match=f"in use by run {holder['run_id']} on .* which is alive"):
        run_job(spec_from_dict(data), show_progress=False)
    go.touch()  # the first run goes on
    # ~10 s on a quiet machine; under `stress --cpu 2` on 2 cores its worker start alone took over a minute and the
    # run more than 120 s (a wait of 120 s failed there), so the wait is generous and says what it waited for
    first.join(timeout=480)
    assert not first.is_alive(), "the first run did not end within 480 s"
    assert box["result"].ok and _ids(str(out)) == ids
    assert json.loads((out / "_lease.json").read_text())["state"] == "released"
    # a holder on another host that stopped renewing (crashed there): taken over after its ttl on our clock
    stale = {**holder, "run_id": "crashed", "host": "elsewhere", "state": "held", "generation": 9, "ttl_s": 5.0}
    (out / "_lease.json").write_text(json.dumps(stale))
    assert run_job(spec_from_dict(data), show_progress=False).ok
    lease = json.loads((out / "_lease.json").read_text())
    assert lease["state"] == "released" and lease["generation"] == 10
    assert read_manifest_file(out)["lease_generation"] == 10


def test_workers_that_cannot_load_end_the_job_with_the_reason(local_ray, tmp_path):
    write_prompts(tmp_path / "in.parquet", 16)
    spec = spec_from_dict(fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out"),
                                    engine={"factory": "tests.driver.no_such_module:make"}))
    result = run_job(spec, show_progress=False)
    assert not result.ok and not result.failed
    # which worker was last depends on how many the pool had started when the third failure came in
    assert re.match(r"3 workers in a row failed to start; last: worker w\d+: failed to start: ", result.error)
    assert "engine.factory 'tests.driver.no_such_module:make': cannot import" in result.error
    assert {e["status"] for e in read_manifest_file(tmp_path / "out")["shards"].values()} == {"pending"}


def test_worker_replacements_are_limited_by_a_rate_not_a_total(local_ray, tmp_path):
    from jobrunner.driver.pool import WorkerPool

    data = fake_spec("unused", str(tmp_path / "out"),
                     cluster={"num_workers": 2, "max_worker_restarts": 1, "worker_restart_window_s": 3600})
    pool = WorkerPool(spec_from_dict(data), 0, 0.0, "rate")
    pool.top_up(2)  # the pool is empty (its workers were lost): one replacement per window
    assert [w.worker_id for w in pool.workers] == ["w0"]
    pool.top_up(2)
    assert len(pool.workers) == 1
    pool.restart_times[0] -= 3601  # that replacement is now older than the window (no sleeping, no race)
    pool.top_up(2)  # the pool grows back to num_workers
    assert [w.worker_id for w in pool.workers] == ["w0", "w1"]
    for w in list(pool.workers):
        pool.remove(w, "test over")


def test_workers_run_at_the_niceness_the_spec_asks(local_ray, tmp_path):
    """Ray renices the workers it starts to 15 (a worker then gets ~1/30 of a core beside each busy process of
    normal priority); cluster.worker_niceness sets it, here to 7, and the worker reports what it runs at."""
    write_prompts(tmp_path / "in.parquet", 8)
    spec = spec_from_dict(fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out"),
                                    cluster={"num_workers": 1, "worker_niceness": 7}))
    assert run_job(spec, show_progress=False).ok
    assert [w["niceness"] for w in read_manifest_file(tmp_path / "out")["workers"].values()] == [7]
