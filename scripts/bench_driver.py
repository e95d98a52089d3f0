"""Driver scale benchmark: driver CPU, peak RSS, bookkeeping bytes and shards/s against the number of shards.

Runs `jobrunner run` (a separate driver process, so its CPU and memory are its own) with the instant test
engine double (`engine.factory: tests.driver.fake_engine:make_engine`, 10 rows per shard) on a local
multi-node Ray cluster (a head with no CPUs, one 1-CPU node per worker). For each shard count it prints one
JSON line; with --rerun it then runs the same job again over the finished output (resume: nothing to do, no
Ray) and times it; with --kill-resume it also kills the driver half way (SIGKILL), waits for its lease to expire
and resumes, checking that no committed shard is recomputed and timing the first new commit. The last line fits
peak RSS against shards: the driver's memory per added shard. It reads both manifest forms (the shard table
in `_manifest.json` up to format 2, `_shards/*.parquet` from format 3), so the same script measures any tree:
`PYTHONPATH=/path/to/tree python /path/to/tree/scripts/bench_driver.py ...` (workers import its test engine).

    PYTHONPATH=. .venv/bin/python scripts/bench_driver.py --shards 1000 5000 20000 --workers 4 --kill-resume
    PYTHONPATH=. .venv/bin/python scripts/bench_driver.py --shards 10000 100000 --rerun
    PYTHONPATH=. .venv/bin/python scripts/bench_driver.py --shards 200            # smoke run

Not a test: the numbers mean something only on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

REPO = Path(__file__).resolve().parents[1]
ROWS_PER_SHARD = 10
LEASE_TTL_S = 5.0


def write_input(path: Path, num_shards: int) -> None:
    """num_shards x 10 rows, one 10-row row group per shard."""
    n = num_shards * ROWS_PER_SHARD
    table = pa.table({"id": [f"r{i}" for i in range(n)], "prompt": [f"question {i} about things" for i in range(n)]})
    pq.write_table(table, path, row_group_size=ROWS_PER_SHARD)


def job_spec(input_path: Path, out: Path, workers: int) -> dict:
    return {"name": "bench-driver",
            "input": {"url": str(input_path), "prompt_column": "prompt", "id_column": "id",
                      "rows_per_shard": ROWS_PER_SHARD},
            "sampling": {"max_tokens": 4},
            "engine": {"max_num_seqs": 16, "factory": "tests.driver.fake_engine:make_engine"},
            "cluster": {"num_workers": workers, "num_cpus_per_worker": 1},
            "output": {"url": str(out), "lease_ttl_s": LEASE_TTL_S}}


def start_driver(job: Path, address: str) -> subprocess.Popen:
    cmd = [sys.executable, "-c", "from jobrunner.cli import main; main()", "run", str(job), "--address", address,
           "--no-progress", "--no-report"]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_driver(proc: subprocess.Popen) -> dict:
    """Exit status, driver CPU seconds and peak RSS of one driver process, and its RSS (MB) at each tenth of
    its run (sampled every 0.5 s): where the growth is, start-up or per shard, and whether it flattens."""
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    samples.extend(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            except OSError:
                return

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)
    stop.set()
    sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    deciles = [round(samples[min(len(samples) - 1, len(samples) * k // 10)] / 1024, 1) for k in range(1, 11)] \
        if samples else []
    return {"exit": proc.returncode, "driver_cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            "driver_peak_rss_mb": round(usage.ru_maxrss / 1024, 1), "driver_rss_mb_by_tenth": deciles}


def committed_shards(out: Path) -> set[str]:
    """Shards committed so far: compacted into the manifest plus commit records."""
    try:
        manifest = json.loads((out / "_manifest.json").read_text())
    except (OSError, ValueError):
        return set()
    if "shards" in manifest:  # format 1-2: a JSON object per shard
        done = {s for s, e in manifest["shards"].items() if e.get("status") == "committed"}
    else:  # format 3: the shard table is a Parquet file
        table = pq.read_table(out / manifest["shard_table"]["key"], columns=["shard_id", "status"])
        done = {s for s, st in zip(table["shard_id"].to_pylist(), table["status"].to_pylist(), strict=True)
                if st == "committed"}
    records = out / "_commits"
    return done | ({p.stem for p in records.iterdir() if p.suffix == ".json"} if records.exists() else set())


def last_run(out: Path) -> dict:
    manifest = json.loads((out / "_manifest.json").read_text())
    size = (out / "_manifest.json").stat().st_size
    if "shard_table" in manifest:
        size += (out / manifest["shard_table"]["key"]).stat().st_size
    return manifest["runs"][-1] | {"manifest_bytes": size}


def one_size(num_shards: int, workers: int, address: str, root: Path, rerun: bool) -> dict:
    work = root / f"s{num_shards}"
    work.mkdir()
    write_input(work / "in.parquet", num_shards)
    job = work / "job.yaml"
    job.write_text(yaml.safe_dump(job_spec(work / "in.parquet", work / "out", workers)))
    started = time.monotonic()
    usage = wait_driver(start_driver(job, address))
    wall = time.monotonic() - started
    run = last_run(work / "out")
    bookkeeping = run["bookkeeping_bytes"] + run["manifest_bytes"]
    line = {"shards": num_shards, "rows": num_shards * ROWS_PER_SHARD, "wall_s": round(wall, 2),
            "shards_per_s": round(num_shards / wall, 1), **usage, "bookkeeping_bytes": bookkeeping,
            "bookkeeping_bytes_per_shard": round(bookkeeping / num_shards, 1), "manifest_bytes": run["manifest_bytes"],
            "commit_records": run["commit_records"], "compactions": run["compactions"]}
    if rerun:  # everything is committed: the rerun reads the manifest, checks the parts and ends (no Ray)
        started = time.monotonic()
        again = wait_driver(start_driver(job, address))
        line.update(rerun_wall_s=round(time.monotonic() - started, 2), rerun_exit=again["exit"],
                    rerun_peak_rss_mb=again["driver_peak_rss_mb"], rerun_cpu_s=again["driver_cpu_s"])
    return line


def rss_per_shard(lines: list[dict]) -> dict:
    """Least-squares slope of peak RSS against shards: what one more shard costs the driver."""
    xs = [line["shards"] for line in lines]
    ys = [line["driver_peak_rss_mb"] * 1024 * 1024 for line in lines]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var if var else None
    return {"peak_rss_bytes_per_shard": None if slope is None else round(slope, 1), "sizes": xs}


def kill_and_resume(num_shards: int, workers: int, address: str, root: Path) -> dict:
    work = root / f"kill{num_shards}"
    work.mkdir()
    write_input(work / "in.parquet", num_shards)
    out = work / "out"
    job = work / "job.yaml"
    job.write_text(yaml.safe_dump(job_spec(work / "in.parquet", out, workers)))
    proc = start_driver(job, address)
    while len(committed_shards(out)) < num_shards // 2 and proc.poll() is None:
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # A part published a moment before the kill, without its record, is not committed: resume redoes it.
    before = {f"part-{s}.parquet": (out / "parts" / f"part-{s}.parquet").stat().st_mtime_ns
              for s in committed_shards(out)}
    time.sleep(LEASE_TTL_S + 0.5)  # the killed driver's lease expires
    started = time.monotonic()
    usage = wait_driver(start_driver(job, address))
    run = last_run(out)
    recomputed = [n for n, m in before.items() if (out / "parts" / n).stat().st_mtime_ns != m]
    parts = len(list((out / "parts").iterdir()))
    return {"kill_resume_shards": num_shards, "committed_before_kill": len(before),
            "resume_wall_s": round(time.monotonic() - started, 2), "resume_first_commit_s": run["first_commit_s"],
            "resume_shards_committed": run["shards_committed"], "recomputed": len(recomputed),
            "parts": parts, "every_shard_once": parts == num_shards, **usage}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[1000, 5000, 20000])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--kill-resume", action="store_true", help="also kill the largest run half way and resume")
    parser.add_argument("--rerun", action="store_true", help="rerun each finished job (resume with nothing to do)")
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"  # workers import the double
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(args.workers):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-driver-") as tmp:
            lines = []
            for n in args.shards:
                lines.append(one_size(n, args.workers, cluster.address, Path(tmp), args.rerun))
                print(json.dumps(lines[-1]), flush=True)
            if len(lines) > 1:
                print(json.dumps(rss_per_shard(lines)), flush=True)
            if args.kill_resume:
                print(json.dumps(kill_and_resume(max(args.shards), args.workers, cluster.address, Path(tmp))),
                      flush=True)
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
