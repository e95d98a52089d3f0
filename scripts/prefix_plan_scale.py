"""Prefix-aware planning at scale: wall time and peak RSS of planning against the number of rows.

For each size, one Parquet file of N rows (row groups of 65,536), each prompt one of `--prefixes` ~600-character
shared prefixes plus a short question, shuffled, is planned in a fresh process (`plan_job`: listing, the key
scan, the sort, the cuts and the row order written locally; no Ray, no engine). Printed per size: planning wall
seconds, peak RSS of the planning process (MB), spilled sorted runs, shards, files grouped. The key sort keeps
2 M records in memory before it spills, so RSS should stop growing with N past a few million rows.

    PYTHONPATH=. .venv/bin/python scripts/prefix_plan_scale.py --rows 100000 1000000
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

CHILD = """
import json, resource, sys, time
from jobrunner.driver.plan import plan_job
from jobrunner.spec import spec_from_dict
url, out = sys.argv[1], sys.argv[2]
spec = spec_from_dict({"name": "scale", "input": {"url": url, "prompt_column": "prompt", "id_column": "id",
                       "rows_per_shard": 1000}, "output": {"url": out}})
t0 = time.monotonic()
plan = plan_job(spec)
print(json.dumps({"plan_s": round(time.monotonic() - t0, 2),
                  "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                  "spilled_runs": plan.prefix.spilled_runs, "shards": len(plan.shards),
                  "files_grouped": plan.prefix.files_grouped}))
"""


def write_input(path: Path, num_rows: int, num_prefixes: int) -> None:
    rng = random.Random(0)
    heads = [f"Instructions, variant {k}: " + "answer the question step by step, showing the work. " * 11
             for k in range(num_prefixes)]
    writer = None
    for start in range(0, num_rows, 65536):
        rows = range(start, min(num_rows, start + 65536))
        prompts = [heads[rng.randrange(num_prefixes)] + f"Q: what is {i} plus {i % 97}?\nA:" for i in rows]
        table = pa.table({"id": [f"r{i}" for i in rows], "prompt": prompts})
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table, row_group_size=65536)
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--prefixes", type=int, default=64)
    args = parser.parse_args()
    for n in args.rows:
        with tempfile.TemporaryDirectory(prefix="prefix-scale-") as tmp:
            path = Path(tmp) / "in.parquet"
            write_input(path, n, args.prefixes)
            done = subprocess.run([sys.executable, "-c", CHILD, str(path), str(Path(tmp) / "out")],
                                  capture_output=True, text=True, check=True)
            line = json.loads(done.stdout.strip().splitlines()[-1])
            print(json.dumps({"rows": n, "input_mb": round(path.stat().st_size / 2**20, 1), **line}), flush=True)


if __name__ == "__main__":
    main()
