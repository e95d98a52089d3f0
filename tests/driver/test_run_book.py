"""The book's side of run records, without Ray: a run that stops (Ctrl-C) or dies (no last word) is kept with
its workers by the next run, a run that committed nothing too (its output replaced), and the totals price them
all."""

from __future__ import annotations

from jobrunner.driver.manifest import JobBook
from jobrunner.driver.output import open_output
from jobrunner.io.layout import part_key
from jobrunner.io.parts import rows_to_table, write_part
from jobrunner.io.reader import ROW_INDEX
from jobrunner.io.run_records import KILLED, read_run_records
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import fake_spec, planned, write_prompts

WORKER = {"startup_s": 4.0, "alive_s": 6.0, "num_sampled_tokens": 40}


def _spec(tmp_path, **sections):
    return spec_from_dict(fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out"), **sections))


def _run(spec):
    """Open the output as a run does and begin the run's book."""
    plan, previous = planned(spec)
    storage, manifest, lease = open_output(spec, plan, previous)
    book = JobBook(storage, manifest, plan.shards, background=False)
    book.begin_run("2026-12-06T00:00:00+00:00")
    book.compact(drop_all_records=True)
    return book, lease


def test_a_stopped_and_a_killed_run_are_kept_with_their_workers(tmp_path):
    write_prompts(tmp_path / "in.parquet", 32)
    spec = _spec(tmp_path)
    book, lease = _run(spec)  # run 0: Ctrl-C after its worker reported
    book.record_worker("w0", WORKER)
    book.finish_run("2026-12-06T00:00:00+00:00", 12.0, False, {}, stopped_by=KeyboardInterrupt())
    book.compact()
    book.write_run_record()
    lease.release()
    assert [(r["run_index"], r["status"], r["worker_seconds"]) for r in book.manifest["runs"]] == \
        [(0, "interrupted", 10.0)]

    book, lease = _run(spec)  # run 1: writes its running record, then dies without a word
    book.record_worker("r1w0", {**WORKER, "alive_s": 2.0})
    book.keep_run_record(None)
    book.ledger.write(book._run_record("running", None))  # the write the thread makes, now (no thread race)
    _commit_first_shard(book, "r1w0")  # committed after its last record: the table says so, the record not
    lease.release()  # as a takeover would find it: the lease free, the run gone

    book, lease = _run(spec)  # run 2 folds both in
    runs = book.manifest["runs"]
    assert [(r["run_index"], r["status"]) for r in runs] == [(0, "interrupted"), (1, KILLED)]
    assert set(book.manifest["workers"]) == {"w0", "r1w0"}
    assert book.manifest["totals"]["worker_seconds"] == 16.0  # 4 + 6, then 4 + 2
    # run 0 committed nothing: its 6 busy seconds were lost (redone by run 2); run 1 committed 32 of the 40
    # tokens its engine sampled (its shard, from the table): a fifth of its 2 busy seconds was lost
    assert (runs[1]["rows_committed"], runs[1]["output_tokens_committed"]) == (8, 32)
    assert book.manifest["totals"]["lost_worker_seconds"] == 6.4
    assert [r["run_index"] for r in read_run_records(book.storage)] == [0, 1]
    lease.release()


def test_a_run_that_committed_nothing_keeps_its_paid_workers_when_replaced(tmp_path):
    write_prompts(tmp_path / "in.parquet", 32)
    book, lease = _run(_spec(tmp_path))
    book.record_worker("w0", WORKER)
    book.finish_run("2026-12-06T00:00:00+00:00", 12.0, False, {}, stopped_by=RuntimeError("no"))
    book.compact()
    book.write_run_record()
    lease.release()
    book, lease = _run(_spec(tmp_path, input={"rows_per_shard": 4}))  # another plan: the output is replaced
    assert [(r["run_index"], r["status"]) for r in book.manifest["runs"]] == [(0, "failed")]
    assert book.manifest["workers"]["w0"]["alive_s"] == 6.0
    assert book.manifest["totals"]["worker_seconds"] == 10.0
    lease.release()


def _commit_first_shard(book: JobBook, worker_id: str) -> None:
    shard_id = book.shards.columns.id_of(0)
    rows = [{"id": f"p{i:03d}", ROW_INDEX: i, "finish_reason": "length"} for i in range(8)]
    write_part(book.storage, shard_id, rows_to_table(rows))  # a real part of 8 rows: the resume checks it
    book.commit(shard_id, {"rows": 8, "num_errors": 0, "num_prompt_tokens": 8, "num_cached_tokens": 0,
                           "num_output_tokens": 32, "worker_id": worker_id, "attempts": 1, "seconds": 0.1,
                           "part": part_key(shard_id), "parts": [part_key(shard_id)]}, {})
