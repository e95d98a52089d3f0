"""What a resume checks before trusting an earlier run (no Ray: the output is opened as `run` opens it):
pinned input files (size, ETag / mtime, footer or content digest) and whole parts (size, footer row count)."""

from __future__ import annotations

import shutil

import fsspec
import pytest

from jobrunner.driver.manifest import JobBook, ResumeError
from jobrunner.driver.output import describe_output, open_output
from jobrunner.io.manifest import read_manifest_with_records
from jobrunner.io.parts import rows_to_table, write_part
from jobrunner.io.reader import ROW_INDEX, InputError, read_rows
from jobrunner.io.shard_file import COMMITTED, PENDING, STATUS_VALUES
from jobrunner.io.storage import Storage
from jobrunner.io.text_input import read_input_rows
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import fake_spec, new_bucket, planned, write_prompts


def _where(kind: str, tmp_path, request) -> tuple[str, dict]:
    if kind == "file":
        return str(tmp_path), {}
    s3 = request.getfixturevalue("s3_server")
    return f"s3://{new_bucket(s3)}", s3["storage_options"]


def _first_run(spec, committed: int = 1, first: int = 0) -> dict:
    """Open the output as `run` does and commit shards `first` to `committed` - 1 with their real rows."""
    plan, previous = planned(spec)
    storage, manifest, lease = open_output(spec, plan, previous)
    book = JobBook(storage, manifest, plan.shards, background=False)
    for shard in list(plan.shards)[first:committed]:
        rows = [{"id": f"p{i:03d}", ROW_INDEX: i, "generated_text": "x", "finish_reason": "length", "error": None,
                 "num_prompt_tokens": 1, "num_cached_tokens": 0, "num_output_tokens": 1,
                 "shard_id": shard.shard_id, "worker_id": "w0", "finish_time_s": 1.0}
                for i in range(shard.row_start, shard.row_end)]
        part = write_part(storage, shard.shard_id, rows_to_table(rows))
        size = storage.fs.info(storage.path(part))["size"]
        book.commit(shard.shard_id, {"rows": len(rows), "num_errors": 0, "num_prompt_tokens": 1,
                                     "num_cached_tokens": 0, "num_output_tokens": 1, "worker_id": "w0",
                                     "attempts": 1, "seconds": 0.1, "part": part, "parts": [part],
                                     "part_bytes": [size]}, {})
    book.compact()
    lease.release()
    # what the run left, in the one-dict-per-shard form (records folded in), `inputs` included
    return read_manifest_with_records(Storage(spec.output.url, spec.output.storage_options))


def _statuses(spec) -> dict:
    plan, previous = planned(spec)  # open_output puts the resumed state into plan.shards
    storage, manifest, lease = open_output(spec, plan, previous)
    lease.release()
    return {plan.shards.id_of(i): STATUS_VALUES[int(c)] for i, c in enumerate(plan.shards.columns.status)}


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_a_resume_over_a_changed_input_file_refuses_naming_it(kind, tmp_path, request):
    base, opts = _where(kind, tmp_path, request)
    write_prompts(f"{base}/in/a.parquet", 16, storage_options=opts)
    spec = spec_from_dict(fake_spec(f"{base}/in", f"{base}/out", opts))
    manifest = _first_run(spec)
    assert [p["rows"] for p in manifest["inputs"]] == [16] and manifest["inputs"][0]["digest"]
    assert ("etag" in manifest["inputs"][0]) == (kind == "s3")
    # rewritten between runs: the same ids and row count, other prompts
    write_prompts(f"{base}/in/a.parquet", 16, storage_options=opts, poison=3)
    changed = spec_from_dict(fake_spec(f"{base}/in", f"{base}/out", opts))
    for attempt in (lambda: open_output(changed, *planned(changed)),
                    lambda: describe_output(changed, *planned(changed))):
        with pytest.raises(ResumeError, match=r"input file .*/in/a\.parquet changed \(.*content differs"):
            attempt()


def test_a_file_put_back_resumes_and_a_missing_one_is_named(tmp_path):
    write_prompts(tmp_path / "in" / "a.parquet", 16)
    write_prompts(tmp_path / "in" / "b.parquet", 8)
    spec = spec_from_dict(fake_spec(str(tmp_path / "in"), str(tmp_path / "out"), input={"id_column": None}))
    _first_run(spec)
    shutil.move(tmp_path / "in" / "b.parquet", tmp_path / "b.parquet")
    with pytest.raises(ResumeError, match=r"input file .*/in/b\.parquet is missing"):
        open_output(spec, *planned(spec))
    shutil.copy(tmp_path / "b.parquet", tmp_path / "in" / "b.parquet")  # back, with a new mtime
    assert sorted(_statuses(spec).values()) == ["committed", "pending", "pending"]


def test_nothing_committed_means_nothing_to_mix(tmp_path):
    write_prompts(tmp_path / "in.parquet", 16)
    spec = spec_from_dict(fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out")))
    _first_run(spec, committed=0)
    write_prompts(tmp_path / "in.parquet", 16, poison=1)
    assert set(_statuses(spec).values()) == {"pending"}


def test_the_old_manifest_is_read_again_only_when_another_run_held_the_lease_since(tmp_path):
    """run_job reads the output once, before planning; a run that took the lease after that read (and
    committed a shard) is not forgotten: open_output reads the manifest again."""
    write_prompts(tmp_path / "in.parquet", 24)
    spec = spec_from_dict(fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out")))
    _first_run(spec, committed=1)
    plan, stale = planned(spec)  # read: shard 0 committed
    _first_run(spec, committed=2, first=1)  # another run commits shard 1 meanwhile
    storage, manifest, lease = open_output(spec, plan, stale)
    lease.release()
    assert not stale.is_current(lease)
    assert list(plan.shards.columns.status) == [COMMITTED, COMMITTED, PENDING]
    plan, fresh = planned(spec)
    storage, manifest, lease = open_output(spec, plan, fresh)
    lease.release()
    assert fresh.is_current(lease)
    assert list(plan.shards.columns.status) == [COMMITTED, COMMITTED, PENDING]


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_parts_are_checked_before_they_are_trusted(kind, tmp_path, request):
    base, opts = _where(kind, tmp_path, request)
    write_prompts(f"{base}/in.parquet", 32, storage_options=opts)
    spec = spec_from_dict(fake_spec(f"{base}/in.parquet", f"{base}/out", opts))
    manifest = _first_run(spec, committed=3)
    sids = [sid for sid, e in manifest["shards"].items() if e["status"] == "committed"]
    parts = [manifest["shards"][sid]["part"] for sid in sids]
    fs = fsspec.filesystem("s3", **opts) if kind == "s3" else fsspec.filesystem("file")
    out = f"{base}/out".removeprefix("s3://")
    data = fs.cat_file(f"{out}/{parts[0]}")
    fs.pipe_file(f"{out}/{parts[0]}", data[: len(data) // 2])  # truncated: no footer
    table = rows_to_table([{"id": "p999", ROW_INDEX: 0, "finish_reason": "length"}])
    write_part(_output_storage(spec), sids[1], table)  # a whole part, with the wrong rows
    statuses = _statuses(spec)
    assert [statuses[sid] for sid in sids] == ["pending", "pending", "committed"]
    assert not fs.exists(f"{out}/{parts[0]}") and not fs.exists(f"{out}/{parts[1]}")  # deleted as orphans
    assert fs.exists(f"{out}/{parts[2]}")


def _output_storage(spec):
    from jobrunner.io.storage import Storage

    return Storage(spec.output.url, spec.output.storage_options)


def test_an_input_file_deleted_mid_job_is_named(tmp_path):
    write_prompts(tmp_path / "in.parquet", 8)
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    (tmp_path / "in.parquet").unlink()
    (tmp_path / "in.jsonl").unlink()
    with pytest.raises(InputError, match=r"in\.parquet is gone \(deleted or moved after the job was planned\)"):
        read_rows(str(tmp_path / "in.parquet"), {}, 0, 8, ["prompt"])
    with pytest.raises(InputError, match=r"in\.jsonl is gone"):
        read_input_rows(str(tmp_path / "in.jsonl"), {}, "jsonl", 0, 1, ["prompt"])


def test_pins_record_text_files_too(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n')
    spec = spec_from_dict(fake_spec(str(tmp_path / "in.jsonl"), str(tmp_path / "out"),
                                    output={"keep_columns": []}))
    [pin] = _first_run(spec)["inputs"]
    assert pin["bytes"] == len((tmp_path / "in.jsonl").read_bytes()) and pin["rows"] == 2 and pin["mtime"]
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "z"}\n{"id": "b", "prompt": "y"}\n')
    with pytest.raises(ResumeError, match=r"in\.jsonl changed \(content differs"):
        open_output(spec, *planned(spec))


def test_another_jobs_committed_output_is_a_conflict_naming_both_names(tmp_path):
    write_prompts(tmp_path / "in.parquet", 16)
    spec = spec_from_dict(fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out")))
    _first_run(spec)
    other = spec_from_dict({**fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out")), "name": "nightly"})
    with pytest.raises(ResumeError, match=r"committed shard\(s\) written with other settings:\n  name: 'fake-job' "
                                          r"-> 'nightly' \(another job's output"):
        open_output(other, *planned(other))


def test_task_and_pooling_are_part_of_the_resume_check():
    from jobrunner.driver.resume_check import spec_differences

    old = {"model": {}, "sampling": {}, "input": {}}  # written before embed / score jobs: it generated
    assert spec_differences(old, {**old, "task": "generate", "embed": {"pooling": "auto", "normalize": "auto"}}) == []
    changed = spec_differences(old, {**old, "task": "embed", "embed": {"pooling": "mean", "normalize": "auto"},
                                     "input": {"completion_column": None}})
    assert [(f, new) for f, _, new in changed] == [("embed.pooling", "mean"), ("task", "embed")]


def test_a_setting_added_later_with_an_empty_default_is_no_change():
    """An output written before model.adapters existed resumes with today's spec, which has `adapters: {}`."""
    from jobrunner.driver.resume_check import spec_differences

    old = {"model": {"source": "m"}, "sampling": {}, "input": {}}
    assert spec_differences(old, {**old, "model": {"source": "m", "adapters": {}}}) == []
    changed = spec_differences(old, {**old, "model": {"source": "m", "adapters": {"a": "/x"}}})
    assert [(f, new) for f, _, new in changed] == [("model.adapters.a", "/x")]
