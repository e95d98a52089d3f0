"""Ray alone: the driver process's RSS growth per actor call (no jobrunner code), to compare with the job driver.

Two 1-CPU actors on a local multi-node Ray, 4 calls in flight, a small dict per call in and out (what a shard
and its result are); phases of 2,000, 10,000 and 20,000 calls; per phase the RSS growth per call and what is
left after glibc's malloc_trim(0).

    PYTHONPATH=. .venv/bin/python scripts/ray_call_memory.py
    MALLOC_ARENA_MAX=2 PYTHONPATH=. .venv/bin/python scripts/ray_call_memory.py

Not a test: an investigation aid.
"""

from __future__ import annotations

import ctypes
import json
import os
import time

import ray
from ray.cluster_utils import Cluster


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@ray.remote(num_cpus=1)
class Echo:
    def run(self, payload: dict | None, i: int) -> dict:
        return {"shard": i, "rows": 10, "stats": {"a": 1.0, "b": 2}, "part": f"_temporary/x/{i}.parquet"}


def phase(actors: list, n: int) -> None:
    inflight: dict = {}
    i = 0
    while i < n or inflight:
        while len(inflight) < 4 and i < n:
            shard = {"shard_id": f"{i:05d}-abcdef", "url": "/x/in.parquet", "s": i}
            inflight[actors[i % 2].run.remote(shard, i)] = i
            i += 1
        done, _ = ray.wait(list(inflight), num_returns=1, timeout=1.0)
        for ref in done:
            ray.get(ref)
            del inflight[ref]


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, logging_level="WARNING")
    actors = [Echo.remote() for _ in range(2)]
    ray.get([a.run.remote(None, 0) for a in actors])
    env = {k: v for k, v in os.environ.items() if k.startswith(("MALLOC", "RAY_task", "RAY_enable"))}
    try:
        for n in (2000, 10000, 20000):
            before, started = rss(), time.time()
            phase(actors, n)
            after = rss()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            print(json.dumps({"calls": n, "growth_bytes_per_call": round((after - before) / n, 1),
                              "after_trim_per_call": round((rss() - before) / n, 1), "rss_mb": round(after / 2**20, 1),
                              "s": round(time.time() - started, 1), "env": env}), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
