"""Incremental runs (output.mode: incremental, driver/incremental.py): three nights of a growing input on the S3
test server, a crash between publishing a part and its record, the done-id index at 10^6 ids, fingerprints."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from jobrunner.driver.job import run_job
from jobrunner.driver.manifest import ResumeError
from jobrunner.io.done_ids import DoneIds, DoneIdsBuilder
from jobrunner.io.fingerprints import request_fingerprints, text_salt, value_hashes
from jobrunner.io.ids import hash_ids
from jobrunner.io.parts import read_output
from jobrunner.spec import SpecError, spec_from_dict
from tests.driver.helpers import fake_spec, new_bucket

pytestmark = pytest.mark.timeout(600)


def _write(fs, path: str, ids: list[str], prompts: list[str]) -> None:
    table = pa.table({"id": ids, "prompt": prompts, "topic": ["t"] * len(ids)})
    with fs.open(path, "wb") as f:
        pq.write_table(table, f, row_group_size=8)


def _night(bucket: str, opts: dict, date: str, monkeypatch, **output) -> tuple:
    monkeypatch.setenv("JOBRUNNER_DATE", date)
    spec = spec_from_dict(fake_spec(f"s3://{bucket}/in/", f"s3://{bucket}/nightly/{{date}}", opts,
                                    cluster={"num_workers": 1},
                                    output={"mode": "incremental", "skip_done_from": [f"s3://{bucket}/nightly/*"],
                                            **output}))
    result = run_job(spec, show_progress=False)
    assert result.ok, result.summary()
    manifest = result.manifest
    return result, manifest["runs"][-1]["incremental"], manifest


# Four job runs (three nights and a rerun), each starting a worker: ~12 s on a quiet machine; under
# `stress --cpu 2` on 2 cores the first three runs took 8 min 6 s and the module's 600 s cut the fourth.
@pytest.mark.timeout(1500)
def test_three_nights_of_a_growing_input_take_each_id_once(local_ray, s3_server, monkeypatch):
    import s3fs

    opts = s3_server["storage_options"]
    bucket = new_bucket(s3_server)
    fs = s3fs.S3FileSystem(**opts)
    a_ids = [f"a{i:03d}" for i in range(40)]
    prompts = [f"question {i}" for i in range(40)]
    _write(fs, f"{bucket}/in/a.parquet", a_ids[:24], prompts[:24])  # night 1: 24 rows
    _, night1, _ = _night(bucket, opts, "2026-12-01", monkeypatch)
    assert (night1["rows_taken"], night1["rows_skipped"], night1["done_ids"]) == (24, 0, 0)

    _write(fs, f"{bucket}/in/a.parquet", a_ids[:32], prompts[:32])  # night 2: 8 rows appended, a new file
    _write(fs, f"{bucket}/in/b.parquet", ["b0", "b1", "b2"], ["x", "y", "z"])
    _, night2, _ = _night(bucket, opts, "2026-12-02", monkeypatch)
    assert (night2["rows_taken"], night2["rows_skipped"], night2["done_ids"]) == (11, 24, 24)
    assert night2["sources"][1] == {"output": f"s3://{bucket}/nightly/2026-12-01", "done_ids": 24}
    by_file = {e["file"].rsplit("/", 1)[-1]: e for e in night2["files"]}
    assert by_file["a.parquet"]["taken_rows"] == [[24, 32]] and by_file["b.parquet"]["taken_rows"] == [[0, 3]]
    assert "row_order" in by_file["a.parquet"] and "row_order" not in by_file["b.parquet"]  # b is read whole

    # night 2 as if its driver had died after publishing b's part but before its commit record: the rerun
    # deletes that part and runs b's rows once more; a's committed shard is kept, not recomputed
    lost = _uncommit(fs, f"{bucket}/nightly/2026-12-02", "b.parquet")
    _, rerun, manifest = _night(bucket, opts, "2026-12-02", monkeypatch)
    assert (rerun["rows_taken"], rerun["rows_skipped"], rerun["done_ids"]) == (3, 32, 32)
    fs.invalidate_cache()
    workers = {e["file"].rsplit("/", 1)[-1]: e["worker_id"] for e in _entries(fs, f"{bucket}/nightly/2026-12-02")}
    assert workers == {"a.parquet": "w0", "b.parquet": "r1w0"} and not fs.exists(f"{bucket}/nightly/2026-12-02/{lost}")

    changed = list(prompts[:36])
    changed[3] = "question 3, reworded"  # a done id whose request changed: reported, not rerun
    _write(fs, f"{bucket}/in/a.parquet", a_ids[:36], changed)
    result, night3, _ = _night(bucket, opts, "2026-12-03", monkeypatch)
    assert (night3["rows_taken"], night3["rows_skipped"]) == (4, 35)
    assert night3["changed_requests"] == 1 and night3["changed"][0]["id"] == "a003"
    assert "1 done id(s) have a changed request" in result.summary() and "'a003'" in result.summary()

    seen = Counter()
    for date, taken in (("2026-12-01", 24), ("2026-12-02", 11), ("2026-12-03", 4)):
        ids = read_output(f"s3://{bucket}/nightly/{date}", opts).column("id").to_pylist()
        assert len(ids) == taken
        seen.update(ids)
    assert sorted(seen) == sorted(a_ids[:36] + ["b0", "b1", "b2"]) and set(seen.values()) == {1}
    assert read_output(f"s3://{bucket}/nightly/2026-12-01", opts).column("request_fingerprint").null_count == 0

    monkeypatch.setenv("JOBRUNNER_DATE", "2026-12-02")
    resumed = spec_from_dict(fake_spec(f"s3://{bucket}/in/", f"s3://{bucket}/nightly/{{date}}", opts))  # resume
    with pytest.raises(ResumeError, match="written by incremental runs"):
        run_job(resumed, show_progress=False)


def _entries(fs, out: str) -> list[dict]:
    manifest = json.loads(fs.cat_file(f"{out}/_manifest.json"))
    with fs.open(f"{out}/{manifest['shard_table']['key']}", "rb") as f:
        return pq.read_table(f).to_pylist()


def _uncommit(fs, out: str, file_name: str) -> str:
    """Mark the shard of `file_name` pending in the output's shard table, its part left in place (a driver
    that died between publishing a part and writing its record); returns that part's key."""
    manifest = json.loads(fs.cat_file(f"{out}/_manifest.json"))
    key = f"{out}/{manifest['shard_table']['key']}"
    with fs.open(key, "rb") as f:
        table = pq.read_table(f)
    files = pc.cast(table.column("file"), pa.string())
    lost = pc.ends_with(files, file_name)
    status = pc.if_else(lost, "pending", pc.cast(table.column("status"), pa.string()))
    with fs.open(key, "wb") as f:
        pq.write_table(table.set_column(table.schema.get_field_index("status"), "status", status), f)
    fs.rm(f"{out}/_SUCCESS")
    return f"parts/part-{table.filter(lost).column('shard_id')[0].as_py()}.parquet"


def test_skip_done_from_needs_the_incremental_mode(tmp_path):
    with pytest.raises(SpecError, match="output.skip_done_from is set but output.mode is 'resume'"):
        spec_from_dict(fake_spec(str(tmp_path / "in"), str(tmp_path / "out"), output={"skip_done_from": ["x"]}))


def _ids(lo: int, hi: int) -> pa.Array:
    return pc.binary_join_element_wise("item-", pc.cast(pa.array(np.arange(lo, hi)), pa.string()), "")


def test_the_done_id_index_at_a_million_ids():
    builder = DoneIdsBuilder()
    for lo in range(0, 1_000_000, 250_000):
        builder.add(_ids(lo, lo + 250_000), np.arange(lo, lo + 250_000, dtype=np.uint64) + 1, lo // 500_000)
    done = builder.finish()
    assert len(done) == 1_000_000 and done.nbytes < 40 * 1_000_000  # ~26 bytes per id, no object per id
    queries = pa.concat_arrays([_ids(999_000, 1_001_000), pa.array([None, "item-5"])])
    positions, entries = done.lookup(queries)
    assert positions.tolist() == list(range(1000)) + [2001]  # the new ids and the null are not done
    found = pc.cast(queries.take(pa.array(positions)), pa.large_string())
    assert found.equals(done.ids.take(pa.array(entries)))
    assert done.fingerprints[entries[-1]] == 6 and done.sources[entries[0]] == 1


def test_a_hash_collision_never_skips_a_row_that_is_not_done():
    (x,), _ = hash_ids(pa.array(["x"]))
    # two done ids forged to share the hash of "x": "y" (not "x") first, then "x" itself
    only_y = DoneIds(np.array([x], np.uint64), pa.array(["y"], pa.large_string()), np.zeros(1, np.uint64),
                     np.zeros(1, np.int16))
    assert only_y.lookup(pa.array(["x"]))[0].tolist() == []
    both = DoneIds(np.array([x, x], np.uint64), pa.array(["y", "x"], pa.large_string()), np.zeros(2, np.uint64),
                   np.zeros(2, np.int16))
    positions, entries = both.lookup(pa.array(["q", "x"]))
    assert positions.tolist() == [1] and entries.tolist() == [1]


def test_fingerprints_follow_the_request_not_its_encoding():
    messages = pa.array([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "ho"}]])
    with_name = pa.array([[{"role": "user", "content": "hi", "name": None}],
                          [{"role": "user", "content": "ho", "name": "z"}]])
    a, b = value_hashes(messages), value_hashes(with_name)
    assert a[0] == b[0] and a[1] != b[1]  # a field a later file adds, null in the older rows, changes nothing
    swapped = pa.array([[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                        [{"role": "user", "content": "b"}, {"role": "user", "content": "a"}]])
    assert len(set(value_hashes(swapped).tolist())) == 2  # order inside a list matters
    assert value_hashes(pa.array([7, None])).tolist() == [value_hashes(pa.array([7.0]))[0], 0]
    salt = text_salt("job")
    renamed = request_fingerprints(pa.table({"q": ["x"]}), {"prompt": "q"}, salt)
    assert renamed == request_fingerprints(pa.table({"prompt": ["x"]}), {"prompt": "prompt"}, salt)
    assert renamed != request_fingerprints(pa.table({"prompt": ["x"]}), {"prompt": "prompt"}, text_salt("other"))


@pytest.mark.parametrize("grouping", ["auto", "off"])
def test_the_planner_cuts_only_the_rows_taken(tmp_path, grouping):
    from jobrunner.driver.plan import plan_job
    from jobrunner.driver.prefix_plan import plan_prefix_shards
    from tests.driver.prefix_data import group_of, write_prefix_prompts

    rows = write_prefix_prompts(tmp_path / "in.parquet", 200, 5)  # 5 shared prefixes, shuffled
    spec = spec_from_dict({"name": "p", "input": {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt",
                                                  "id_column": "id", "rows_per_shard": 16, "prefix_grouping": grouping},
                           "output": {"url": str(tmp_path / "out"), "mode": "incremental"}})
    files = plan_job(spec).files
    taken = np.arange(3, 200, 2, dtype=np.int64)  # every other row is done
    table, prefix = plan_prefix_shards(spec, files, None, selections=[taken])
    order = np.fromfile(prefix.order_local, "<i8")
    planned = [order[s.order_offset + s.row_start:s.order_offset + s.row_end].tolist() for s in table]
    assert sorted(r for shard in planned for r in shard) == taken.tolist()  # each taken row once, no other
    assert prefix.files_grouped == (grouping == "auto")
    if grouping == "auto":  # the taken rows are still grouped by prefix
        assert all(len({group_of(rows[r][1]) for r in shard}) == 1 for shard in planned)
    else:
        assert [r for shard in planned for r in shard] == taken.tolist()  # in row order


@pytest.mark.parametrize("suffix", ["parquet", "jsonl"])
def test_planning_computes_the_fingerprint_the_worker_writes(tmp_path, suffix):
    from jobrunner.driver.plan import plan_job
    from jobrunner.driver.rows import fingerprint_roles, fingerprint_salt, read_shard_input, row_fingerprints
    from jobrunner.io.done_rows import RequestColumns, scan_file

    messages = [[{"role": "user", "content": f"question {i}"}] for i in range(6)]
    table = pa.table({"id": [f"m{i}" for i in range(6)], "messages": messages, "sampling": ['{"max_tokens": 3}'] * 6})
    path = tmp_path / f"in.{suffix}"

    def write(t):
        if suffix == "parquet":
            pq.write_table(t, path)
        else:
            path.write_text("".join(json.dumps(r) + "\n" for r in t.to_pylist()))

    write(table)
    spec = spec_from_dict({"name": "f", "input": {"url": str(path), "messages_column": "messages", "id_column": "id",
                                                  "sampling_column": "sampling", "system_prompt": "Be brief."},
                           "output": {"url": str(tmp_path / "out"), "mode": "incremental"}})
    written, _ = read_shard_input(spec, str(path), 0, 6)  # what a worker reads, and the fingerprints it writes
    by_row = row_fingerprints(spec, written)
    builder = DoneIdsBuilder()
    builder.add(pa.array([f"m{i}" for i in range(6)]), np.array([by_row[i] for i in range(6)]).view(np.uint64), 0)
    done = builder.finish()
    request = RequestColumns(fingerprint_roles(spec), fingerprint_salt(spec))
    scan = scan_file(plan_job(spec).files[0], {}, "auto", "id", done, request)
    assert (scan.num_skipped, scan.num_changed, scan.num_unchecked) == (6, 0, 0)
    messages[2] = [{"role": "user", "content": "question 2, reworded"}]
    write(table.set_column(1, "messages", pa.array(messages)).append_column("extra", pa.array([1] * 6)))
    scan = scan_file(plan_job(spec).files[0], {}, "auto", "id", done, request)
    assert (scan.num_skipped, scan.num_changed, scan.changed) == (6, 1, [(2, "m2")])
