"""Planning time and read amplification on a local S3 server (moto, own process), for issue 11 item 7.

Writes --files Parquet files (each --rows rows in row groups of --row-group rows, plus a `filler` column no
job reads) to a fresh bucket, then measures:

- planning: listing + every footer + shard cut (`plan_job`), with the footer thread pool and with one thread;
- read amplification: every shard read as --workers workers would (shards dealt out in turn, one footer /
  row-group cache each): bytes fetched / input bytes, footers and column chunks apart; and the same shards
  through the read path before issue 11 (`reads_before`), for comparison.

    PYTHONPATH=. python scripts/bench_plan.py                          # 1,000 files (the issue's figure)
    PYTHONPATH=. python scripts/bench_plan.py --files 20 --rows 500    # a smoke run

Prints one JSON object (and writes it to --out when given). Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import io
import json
import socket
import subprocess
import sys
import time
import urllib.request
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


def _naive_amplification(plan, options: dict, columns: list[str]) -> dict:
    """The read path before issue 11 (a fresh ParquetFile per shard over s3fs's default read-ahead file):
    bytes s3fs fetched / input bytes, for comparison."""
    import s3fs
    from fsspec.core import url_to_fs

    from jobrunner.io.row_groups import groups_for

    fetched = [0]
    original = s3fs.core.S3File._fetch_range

    def counting(self, start: int, end: int) -> bytes:
        data = original(self, start, end)
        fetched[0] += len(data)
        return data

    s3fs.core.S3File._fetch_range = counting
    try:
        for shard in plan.shards:
            fs, path = url_to_fs(shard.file_url, **options)
            with fs.open(path, "rb") as f:
                parquet = pq.ParquetFile(f)
                groups, _ = groups_for(parquet.metadata, shard.row_start, shard.row_end)
                parquet.read_row_groups(groups, columns=columns)
    finally:
        s3fs.core.S3File._fetch_range = original
    input_bytes = sum(f.num_bytes for f in plan.files)
    return {"read_path": "before issue 11", "fetched_bytes": fetched[0],
            "read_amplification": round(fetched[0] / input_bytes, 4)}


def _start_moto() -> tuple[subprocess.Popen, str]:
    """moto's S3 server in its own process (so it does not share this process's GIL) on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=2).close()
            return server, endpoint
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"moto server did not start on {endpoint}") from None
            time.sleep(0.3)


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

    from jobrunner.spec import spec_from_dict

    server, endpoint = _start_moto()
    try:
        options = {"key": "testing", "secret": "testing", "endpoint_url": endpoint}
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
            "reads_before": _naive_amplification(plan, options, ["id", "prompt"]),
        }
    finally:
        server.terminate()
        server.wait(timeout=30)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
