"""Reruns over an existing output (driver/output.py, driver/resume_check.py), without Ray: a run that
committed nothing is replaced whatever changed; a change against committed shards is refused with each
differing field; a dead holder's lease is taken over at once; a fenced book writes nothing after loss."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jobrunner.driver.manifest import JobBook, ResumeError
from jobrunner.driver.output import describe_output, open_output
from jobrunner.driver.resume_check import spec_differences
from jobrunner.io.layout import LEASE, LEASE_GENERATION, part_key
from jobrunner.io.lease import LeaseLost, host_identity, read_lease
from jobrunner.io.parts import list_parts, rows_to_table, write_part
from jobrunner.io.reader import ROW_INDEX
from jobrunner.io.shard_file import COMMITTED
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import fake_spec, planned, read_manifest_file, write_prompts


def _spec(tmp_path, model="tiny-llamma", **sections):
    data = fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out"), **sections)
    data["model"] = {"source": model}
    return spec_from_dict(data)


def _open(spec):
    plan, previous = planned(spec)
    return (*open_output(spec, plan, previous), plan.shards)


def _commit_first_shard(storage, manifest, shards) -> str:
    book = JobBook(storage, manifest, shards)
    shard_id = shards.columns.id_of(0)
    rows = [{"id": f"p{i:03d}", ROW_INDEX: i, "finish_reason": "length"} for i in range(8)]
    write_part(storage, shard_id, rows_to_table(rows))  # a real part of 8 rows: resume checks it
    book.commit(shard_id, {"rows": 8, "num_errors": 0, "num_prompt_tokens": 8, "num_cached_tokens": 0,
                           "num_output_tokens": 32, "worker_id": "w0", "attempts": 1, "seconds": 0.1,
                           "part": part_key(shard_id), "parts": [part_key(shard_id)]}, {})
    return shard_id


def test_a_run_that_committed_nothing_is_replaced_whatever_changed(tmp_path):
    write_prompts(tmp_path / "in.parquet", 32)
    storage, manifest, lease, shards = _open(_spec(tmp_path, model="tiny-llamma"))  # the typo'd first run
    JobBook(storage, manifest, shards).compact(drop_all_records=True)
    storage.write_small("parts/part-stray.parquet", b"x")  # published just before it died, never recorded
    lease.release()
    fixed = _spec(tmp_path, model="tiny-llama", input={"rows_per_shard": 4})  # other model, other shard plan
    assert "committed nothing" in describe_output(fixed, *planned(fixed))
    storage, manifest, lease, shards = _open(fixed)
    assert manifest["spec"]["model"]["source"] == "tiny-llama" and len(shards) == 8
    assert manifest[LEASE_GENERATION] == 2 and list_parts(storage) == []
    lease.release()


def test_a_change_against_committed_shards_lists_each_field_and_both_choices(tmp_path, capsys):
    write_prompts(tmp_path / "in.parquet", 32)
    storage, manifest, lease, shards = _open(_spec(tmp_path, model="tiny-llama"))
    JobBook(storage, manifest, shards).compact(drop_all_records=True)
    _commit_first_shard(storage, manifest, shards)
    lease.release()
    changed = _spec(tmp_path, model="tiny-llama-v2", sampling={"max_tokens": 4, "temperature": 0.5},
                    input={"rows_per_shard": 16})
    with pytest.raises(ResumeError) as info:
        _open(changed)
    message = str(info.value)
    assert "holds 1 committed shard(s) written with other settings" in message
    assert "model.source: 'tiny-llama' -> 'tiny-llama-v2'" in message
    assert "sampling.temperature: 0.0 -> 0.5" in message  # a job's default temperature is 0.0 (greedy)
    assert "shards: 4 before, 2 now" in message and "input.rows_per_shard: 8 -> 16" in message
    assert "output.mode=overwrite" in message and "new output.url" in message
    with pytest.raises(ResumeError, match="model.source"):
        describe_output(changed, *planned(changed))
    assert read_lease(storage)["state"] == "released"  # the refused run released the lease it took
    capsys.readouterr()
    storage, manifest, lease, shards = _open(_spec(tmp_path, model="tiny-llama"))  # the same settings resume
    assert int((shards.columns.status == COMMITTED).sum()) == 1
    said = capsys.readouterr().err
    assert "1 of 4 shards already committed, running the rest" in said and "took over" not in said
    lease.release()


def test_a_crashed_drivers_lease_on_this_host_is_taken_over_at_once(tmp_path, capsys):
    write_prompts(tmp_path / "in.parquet", 16)
    out = tmp_path / "out"
    out.mkdir()
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    (out / LEASE).write_text(json.dumps({"run_id": "crashed", "generation": 3, "state": "held", **host_identity(),
                                         "pid": gone, "ttl_s": 3600}))
    storage, manifest, lease, _ = _open(_spec(tmp_path))  # no wait for the hour-long ttl
    assert lease.generation == 4 and read_lease(storage)["run_id"] == lease.run_id
    said = capsys.readouterr().err  # the operator is told, not left to guess why no countdown ran
    assert "no shard committed yet, running all" in said
    assert f"took over the lease: run crashed on {host_identity()['host']} (pid {gone})" in said
    assert ": no longer running" in said
    lease.release()


def test_a_book_whose_lease_was_lost_writes_nothing(tmp_path):
    write_prompts(tmp_path / "in.parquet", 16)
    storage, manifest, lease, shards = _open(_spec(tmp_path))
    book = JobBook(storage, manifest, shards)
    book.compact(drop_all_records=True)
    before = (tmp_path / "out" / "_manifest.json").read_bytes()
    lease.stop_heartbeat()
    lease.valid_until = 0.0  # as if its renewals had failed for most of the ttl
    with pytest.raises(LeaseLost):
        _commit_first_shard(storage, manifest, shards)
    with pytest.raises(LeaseLost):
        book.compact()
    assert (tmp_path / "out" / "_manifest.json").read_bytes() == before
    assert list_parts(storage) == [] and not (tmp_path / "out" / "_commits").exists()
    assert read_manifest_file(tmp_path / "out")[LEASE_GENERATION] == 1
    lease.release()


def test_a_resume_in_the_other_deterministic_mode_is_refused(tmp_path):
    write_prompts(tmp_path / "in.parquet", 32)
    storage, manifest, lease, shards = _open(_spec(tmp_path, engine={"deterministic": True}))
    JobBook(storage, manifest, shards).compact(drop_all_records=True)
    _commit_first_shard(storage, manifest, shards)
    lease.release()
    with pytest.raises(ResumeError) as info:
        _open(_spec(tmp_path))  # the default mode
    message = str(info.value)
    assert "engine.deterministic: True -> False (the committed rows were made in the other execution mode" in message
    assert "output.mode=overwrite" in message
    # a manifest written before the setting existed was made in the default mode
    assert spec_differences({"engine": {}}, {"engine": {"deterministic": False}}) == []
    assert spec_differences({}, {"engine": {"deterministic": True}}) == [("engine.deterministic", False, True)]
    storage, manifest, lease, shards = _open(_spec(tmp_path, engine={"deterministic": True}))  # same mode resumes
    assert int((shards.columns.status == COMMITTED).sum()) == 1
    lease.release()
