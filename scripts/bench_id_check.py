"""Wall time and peak memory of the duplicate-id check that every run does before work (jobrunner/io/ids.py).

For each size N it writes a local Parquet dataset of N string ids (10 files, row groups of 100k rows, ids
like `doc-0001234567-9f3a`) with one duplicate planted near the end, then runs the check in a fresh process
and prints: wall seconds, peak RSS of that process, its RSS before the check (imports, listing) and the
difference (what the check itself held at its peak), whether the planted duplicate was found, and whether
the (hash, row) records were spilled to disk by bucket (above BUCKET_RECORDS ids).

    PYTHONPATH=. .venv/bin/python scripts/bench_id_check.py --sizes 1000000 10000000
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NUM_FILES = 10


def write_dataset(folder: Path, n: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    per_file = -(-n // NUM_FILES)
    rng = np.random.default_rng(0)
    for i in range(NUM_FILES):
        start, end = i * per_file, min(n, (i + 1) * per_file)
        suffix = rng.integers(0, 1 << 16, end - start)
        ids = [f"doc-{j:010d}-{s:04x}" for j, s in zip(range(start, end), suffix.tolist(), strict=True)]
        if i == NUM_FILES - 1:
            ids[-1] = f"doc-{n // 2:010d}-dup"  # the planted duplicate: the same id as the row before it
            ids[-2] = ids[-1]
        pq.write_table(pa.table({"id": ids}), folder / f"part-{i:02d}.parquet", row_group_size=100_000)


def measure(folder: str) -> dict:
    """Run in a fresh process: list, then time the check (io/ids.py via io/text_input.py)."""
    from jobrunner.io import ids
    from jobrunner.io.text_input import find_input_duplicates, list_input

    files = list_input(folder, {}, "parquet")
    before_kb = _rss_kb()
    t0 = time.perf_counter()
    dups = find_input_duplicates(files, {}, "parquet", "id")
    wall = time.perf_counter() - t0
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows = sum(f.num_rows for f in files)
    return {"ids": rows, "wall_s": round(wall, 2), "peak_rss_mb": round(peak_kb / 1024, 1),
            "rss_before_mb": round(before_kb / 1024, 1), "check_peak_mb": round((peak_kb - before_kb) / 1024, 1),
            "spilled": rows > ids.BUCKET_RECORDS, "found": [d.row_id for d in dups]}


def _rss_kb() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize() // 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    for n in args.sizes:
        with tempfile.TemporaryDirectory(prefix="bench-ids-") as tmp:
            write_dataset(Path(tmp), n)
            out = subprocess.run([sys.executable, __file__, "--measure", tmp], check=True, capture_output=True,
                                 text=True).stdout
            print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
