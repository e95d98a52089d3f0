"""Driver bookkeeping at 10^4-10^6 shards without Ray: memory per shard, the longest loop stall, resume time.

Does what the job loop does with its books, in one process per size (so peak RSS is that size's): plan N
shards of one synthetic file (no I/O), open the manifest and the task queue, commit every shard through
`JobBook.mark_committed` (no part, no record: the loop's own work, compactions included, on local disk; as no
record is written, compactions skip deleting them), write the last compaction, then read the manifest back as
a resume does. Prints one JSON line per size:

- `peak_rss_mb`: the process's peak RSS; `rss_per_shard_b` fits it against N over the sizes given;
- `max_commit_stall_ms`: the longest single `mark_committed` call, i.e. how long a compaction held the loop;
- `commit_us_per_shard`, `final_compaction_s`, `resume_read_s` (manifest + shard table, checks, state adopted).

Works on trees before and after the shard table (issue 15 item 12), so the same command measures both:

    PYTHONPATH=. .venv/bin/python scripts/bench_bookkeeping.py --shards 10000 100000 1000000
    PYTHONPATH=/tmp/before .venv/bin/python scripts/bench_bookkeeping.py --shards 10000 100000

Not a test: the numbers mean something only on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time

ROWS_PER_SHARD = 10


def measure(num_shards: int, out: str) -> dict:
    """One size, in this process."""
    from jobrunner.driver import manifest as mf
    from jobrunner.driver.output import open_output, read_previous_output

    # No record is written here, and deleting keys that do not exist costs one failed call each (~0.1 ms):
    # a cost of this bench, not of a job (whose records exist and go in one batched delete).
    mf.delete_commit_records = lambda storage, shard_ids: None
    from jobrunner.driver.plan import JobPlan
    from jobrunner.driver.shards import plan_shards
    from jobrunner.io.reader import InputFile
    from jobrunner.spec import spec_from_dict

    spec = spec_from_dict({"name": "bench-books", "input": {"url": "/data/in.parquet", "prompt_column": "p",
                                                            "rows_per_shard": ROWS_PER_SHARD},
                           "output": {"url": out, "lease_ttl_s": 600}})
    files = [InputFile(url="file:///data/in.parquet", stem="in", num_rows=ROWS_PER_SHARD * num_shards,
                       row_group_num_rows=(ROWS_PER_SHARD,) * num_shards)]
    t0 = time.perf_counter()
    plan = JobPlan(files=files, shards=plan_shards(files, ROWS_PER_SHARD))
    plan_s = time.perf_counter() - t0
    storage, manifest, lease = open_output(spec, plan, read_previous_output(spec))
    book, ids, holders = _open_books(mf, storage, manifest, plan)
    setup_s = time.perf_counter() - t0
    book.compact(drop_all_records=True)
    stall, t1 = 0.0, time.perf_counter()
    for shard_id in ids:
        entry = {"rows": ROWS_PER_SHARD, "num_errors": 0, "num_prompt_tokens": 50, "num_cached_tokens": 0,
                 "num_output_tokens": 40, "worker_id": "w0", "attempts": 1, "failures": 0, "infra_failures": 0,
                 "seconds": 0.01, "part": f"parts/part-{shard_id}.parquet",
                 "parts": [f"parts/part-{shard_id}.parquet"]}
        started = time.perf_counter()
        book.mark_committed(shard_id, book.record_for(shard_id, entry, {}), 300)
        stall = max(stall, time.perf_counter() - started)
    commit_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    if hasattr(book, "wait"):
        book.wait()
    book.compact()
    final_s = time.perf_counter() - t2
    lease.release()
    del holders
    t3 = time.perf_counter()
    again = JobPlan(files=files, shards=plan_shards(files, ROWS_PER_SHARD))
    open_output(spec, again, read_previous_output(spec))[2].release()  # resume: read, check the plan, adopt
    resume_s = time.perf_counter() - t3
    return {"shards": num_shards, "plan_s": round(plan_s, 2), "setup_s": round(setup_s, 2),
            "commit_us_per_shard": round(1e6 * commit_s / num_shards, 1),
            "max_commit_stall_ms": round(1e3 * stall, 1), "compactions": book.num_compactions,
            "final_compaction_s": round(final_s, 2), "resume_read_s": round(resume_s, 2),
            "bookkeeping_bytes_written": book.bytes_written,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def _open_books(mf, storage, manifest, plan) -> tuple:
    """JobBook, the shard ids to commit, and what the loop holds per shard (queue, in-flight work)."""
    from jobrunner.driver import tasks

    if hasattr(tasks, "FreshTasks"):  # the shard table: tasks only for shards handed out
        shards = plan.shards
        queue = tasks.TaskQueue(fresh=tasks.FreshTasks(shards.todo(), lambda row: tasks.Task(
            shards.id_of(row), *shards.rows_of(row))))
        ids = (shards.id_of(i) for i in range(len(shards)))
        return mf.JobBook(storage, manifest, shards), ids, queue
    # Before: a Shard per shard (the loop's dict), a Task and a ShardWork per shard to run.
    by_id = {s.shard_id: s for s in plan.shards}
    todo = [tasks.Task(s.shard_id, s.row_start, s.row_end) for s in plan.shards]
    work = {t.shard_id: tasks.ShardWork() for t in todo}
    return mf.JobBook(storage, manifest), list(by_id), (by_id, tasks.TaskQueue(todo), work)


def rss_per_shard(lines: list[dict]) -> float | None:
    """Least-squares slope of peak RSS (bytes) against shards."""
    xs, ys = [line["shards"] for line in lines], [line["peak_rss_mb"] * 2 ** 20 for line in lines]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    return round(sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var, 1) if var else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: measure one size
    args = parser.parse_args()
    if args.one:
        with tempfile.TemporaryDirectory(prefix="bench-books-") as tmp:
            print(json.dumps(measure(args.one, f"{tmp}/out")), flush=True)
        return
    lines = []
    for n in args.shards:
        child = subprocess.run([sys.executable, __file__, "--one", str(n)], capture_output=True, text=True)
        if child.returncode:
            print(child.stderr[-2000:], file=sys.stderr)
            raise SystemExit(child.returncode)
        lines.append(json.loads(child.stdout.strip().splitlines()[-1]))
        print(json.dumps(lines[-1]), flush=True)
    if len(lines) > 1:
        print(json.dumps({"rss_per_shard_b": rss_per_shard(lines), "sizes": args.shards}), flush=True)


if __name__ == "__main__":
    main()
