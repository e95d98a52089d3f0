"""Planning time and read amplification on a local S3 server (moto), for issue 11 item 7.

Writes --files Parquet files (each --rows rows in row groups of --row-group rows, plus a `filler` column no
job reads) to a fresh bucket, then measures:

- planning: listing + every footer + shard cut (`plan_job`), with the footer thread pool and with one thread;
- read amplification: every shard read as --workers workers would (shards dealt out in turn, one footer /
  row-group cache each): bytes fetched / input bytes, footers and column chunks apart.

    PYTHONPATH=. python scripts/bench_plan.py                          # 1,000 files (the issue's figure)
    PYTHONPATH=. python scripts/bench_plan.py --files 20 --rows 500    # a smoke run

Prints one JSON object (and writes it to --out when given). Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq


def _file_bytes(index: int, rows: int, row_group: int) -> bytes:
    ids = [f"f{index}-r{i}" for i in range(rows)]
    table = pa.table({"id": ids, "prompt": [f"question {i} of file {index}" for i in range(rows)],
                      "filler": ["x" * 200 + str(i) for i in range(rows)]})
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=row_group)
    return buf.getvalue()


def _write_inputs(fs, bucket: str, args: argparse.Namespace) -> int:
    def put(i: int) -> int:
        data = _file_bytes(i, args.rows, args.row_group)
        fs.pipe_file(f"{bucket}/in/part-{i:05d}.parquet", data)
        return len(data)

    with ThreadPoolExecutor(16) as pool:
        return sum(pool.map(put, range(args.files)))


def _plan(spec, threads: int) -> tuple[object, float]:
    from jobrunner.driver.plan import plan_job
    from jobrunner.io import reader

    saved = reader.FOOTER_THREADS
    reader.FOOTER_THREADS = threads
    try:
        start = time.perf_counter()
        plan = plan_job(spec)
        return plan, time.perf_counter() - start
    finally:
        reader.FOOTER_THREADS = saved


def _amplification(plan, options: dict, workers: int, columns: list[str]) -> dict:
    from jobrunner.io.reader import read_rows
    from jobrunner.io.row_groups import ReadStats, RowGroupCache

    stats, caches = ReadStats(), [RowGroupCache() for _ in range(workers)]
    start = time.perf_counter()
    for i, shard in enumerate(plan.shards):
        read_rows(shard.file_url, options, shard.row_start, shard.row_end, columns, stats, caches[i % workers])
    input_bytes = sum(f.num_bytes for f in plan.files)
    return {"workers": workers, "dealing": "one shard to each worker in turn (worst case)",
            "input_bytes": input_bytes, "footer_bytes": stats.footer_bytes,
            "data_bytes": stats.data_bytes, "num_reads": stats.num_reads,
            "read_amplification": round(stats.total_bytes / input_bytes, 4),
            "read_s": round(time.perf_counter() - start, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=2000, help="rows per file")
    parser.add_argument("--row-group", type=int, default=500, help="rows per row group")
    parser.add_argument("--rows-per-shard", type=int, default=250, help="< --row-group: groups are split")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per S3 request otherwise

    from jobrunner.spec import spec_from_dict

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        options = {"key": "testing", "secret": "testing", "endpoint_url": f"http://{host}:{port}"}
        fs = s3fs.S3FileSystem(**options)
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        fs.mkdir(bucket)
        written = _write_inputs(fs, bucket, args)
        spec = spec_from_dict({"name": "bench-plan", "output": {"url": f"s3://{bucket}/out"},
                               "input": {"url": f"s3://{bucket}/in/", "prompt_column": "prompt",
                                         "id_column": "id", "rows_per_shard": args.rows_per_shard,
                                         "storage_options": options}})
        plan, parallel_s = _plan(spec, threads=32)
        _, serial_s = _plan(spec, threads=1)
        result = {
            "files": args.files, "rows": plan.num_rows, "shards": len(plan.shards), "input_bytes": written,
            "row_group_rows": args.row_group, "rows_per_shard": args.rows_per_shard,
            "plan_s_parallel_footers": round(parallel_s, 3), "plan_s_one_thread": round(serial_s, 3),
            "reads": [_amplification(plan, options, w, ["id", "prompt"]) for w in (1, args.workers)],
        }
    finally:
        server.stop()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
