"""Where the Ray driver's memory per shard goes: run one job in this process and look inside.

Runs `run_job` in-process (instant engine double, 10 rows per shard, a local multi-node Ray cluster as in
scripts/bench_driver.py) while a thread samples this process's RSS, then prints what is left once the job has
ended: RSS now and after glibc's `malloc_trim(0)`, the objects Ray's core worker still counts references for,
the largest Python object types by count, and tracemalloc's total when `--tracemalloc` is given. The RSS slope
between 25% and 100% of the run, divided by the shards committed in that span, is the growth per shard without
the start-up constant.

    PYTHONPATH=. .venv/bin/python scripts/driver_memory_probe.py --shards 2000 10000
    MALLOC_ARENA_MAX=2 PYTHONPATH=. .venv/bin/python scripts/driver_memory_probe.py --shards 10000

Not a test: an investigation aid; the numbers are for this machine.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import json
import os
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_driver import job_spec, write_input  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Sampler(threading.Thread):
    """RSS every 0.25 s with the time, until stopped."""

    def __init__(self, trim_every_s: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()
        self.trim_every_s, self.next_trim = trim_every_s, time.monotonic() + trim_every_s

    def run(self) -> None:
        while not self.stop.wait(0.25):
            self.samples.append((time.monotonic(), rss_bytes()))
            if self.trim_every_s and time.monotonic() >= self.next_trim:  # what freed memory glibc keeps
                malloc_trim()
                self.next_trim = time.monotonic() + self.trim_every_s


def malloc_trim() -> bool:
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except OSError:
        return False


def one_size(num_shards: int, workers: int, root: Path, trim_every_s: float = 0.0) -> dict:
    from jobrunner.driver.job import run_job
    from jobrunner.spec import spec_from_dict

    work = root / f"s{num_shards}"
    work.mkdir()
    write_input(work / "in.parquet", num_shards)
    spec = spec_from_dict(job_spec(work / "in.parquet", work / "out", workers))
    gc.collect()
    start_rss = rss_bytes()
    sampler = Sampler(trim_every_s)
    sampler.start()
    t0 = time.monotonic()
    result = run_job(spec, show_progress=False)
    wall = time.monotonic() - t0
    sampler.stop.set()
    sampler.join()
    end_rss = rss_bytes()
    samples = sampler.samples
    # growth over the steady part of the run: from a quarter of the wall time to the end
    quarter = next((r for t, r in samples if t - t0 >= wall / 4), samples[0][1])
    peak = max(r for _, r in samples)
    steady_shards = num_shards * 3 / 4
    return {"shards": num_shards, "ok": result.ok if hasattr(result, "ok") else None, "wall_s": round(wall, 1),
            "rss_start_mb": round(start_rss / 2**20, 1), "rss_peak_mb": round(peak / 2**20, 1),
            "rss_end_mb": round(end_rss / 2**20, 1),
            "growth_bytes_per_shard_steady": round((samples[-1][1] - quarter) / steady_shards, 1),
            "growth_bytes_per_shard_whole": round((end_rss - start_rss) / num_shards, 1)}


def inspect_after() -> dict:
    import ray

    out: dict = {}
    try:
        counts = ray._private.worker.global_worker.core_worker.get_all_reference_counts()
        out["ray_reference_counts"] = len(counts)
    except Exception as exc:  # noqa: BLE001 - an internal API: report what happened
        out["ray_reference_counts"] = f"n/a ({exc})"
    gc.collect()
    types = collections.Counter(type(o).__name__ for o in gc.get_objects())
    out["top_python_types"] = types.most_common(8)
    before = rss_bytes()
    out["malloc_trim_released"] = malloc_trim()
    out["rss_before_trim_mb"], out["rss_after_trim_mb"] = round(before / 2**20, 1), round(rss_bytes() / 2**20, 1)
    import pyarrow as pa

    pool = pa.default_memory_pool()
    out["arrow_pool"] = {"backend": pool.backend_name, "allocated_mb": round(pool.bytes_allocated() / 2**20, 1),
                         "max_mb": round(pool.max_memory() / 2**20, 1)}
    if tracemalloc.is_tracing():
        current, peak = tracemalloc.get_traced_memory()
        out["tracemalloc_current_mb"], out["tracemalloc_peak_mb"] = round(current / 2**20, 1), round(peak / 2**20, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[2000, 10000])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--tracemalloc", action="store_true")
    parser.add_argument("--trim-every", type=float, default=0.0,
                        help="call malloc_trim(0) every this many seconds during the run (0: never)")
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"  # workers import the double
    import ray
    from ray.cluster_utils import Cluster

    if args.tracemalloc:
        tracemalloc.start()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(args.workers):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING")
    try:
        with tempfile.TemporaryDirectory(prefix="driver-mem-") as tmp:
            for n in args.shards:
                line = one_size(n, args.workers, Path(tmp), args.trim_every)
                line.update(inspect_after())
                line["trim_every_s"] = args.trim_every
                line["env"] = {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "RAY_"))
                               and k != "RAY_ADDRESS"}
                print(json.dumps(line), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
