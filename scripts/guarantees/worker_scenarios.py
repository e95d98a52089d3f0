"""Worker guarantees, each scenario run for real (issue 15, items 3 and 4); one JSON result line each.

    PYTHONPATH=. .venv/bin/python scripts/guarantees/worker_scenarios.py            # every scenario
    PYTHONPATH=. .venv/bin/python scripts/guarantees/worker_scenarios.py --only poison --rows 1000

Scenarios (local Ray, 2 CPUs, the fake engine of tests/driver/fake_engine.py):
- stall: an engine double that steps without progress on one row (progress_timeout_s 3 s): the job ends,
  the row is an error row naming the shard and "no token produced".
- read-hang / write-hang: input and output on a real S3 server (moto) behind a proxy that stops answering
  reads of the input once the job has started, or part writes (io_timeout_s 3 s, 2 attempts): the job
  ends with the shard failed, its error naming the shard and "reading input rows" / "writing part".
- poison: 1% poison rows (the fake engine raises while one is running) in --rows rows, 1,000 rows per shard,
  2 workers; model loads (= workers started), engine rebuilds, rows isolated, wall time per isolated row.
  Run it against an older checkout (PYTHONPATH=that checkout, this script by path) for "before"; it uses
  only spec keys both know. cluster.max_worker_restarts is raised to 1000 so that the old code's restart
  throttle (10 per 600 s by default) does not dominate the wall time.

Not a test: wall times mean something only on a quiet machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

FAKE = "tests.driver.fake_engine:make_engine"
DEADLINE_S = 3.0


def spec_dict(input_url: str, output_url: str, options: dict | None = None, **sections) -> dict:
    opts = options or {}
    spec = {"name": "worker-scenario",
            "input": {"url": input_url, "prompt_column": "prompt", "id_column": "id", "rows_per_shard": 1000,
                      "storage_options": opts},
            "sampling": {"max_tokens": 4},
            "engine": {"max_num_seqs": 16, "factory": FAKE, "factory_options": {}},
            "cluster": {"num_workers": 2, "num_cpus_per_worker": 1, "retry_backoff_s": 0.2},
            "output": {"url": output_url, "storage_options": opts, "max_error_rate": 0.05}}
    for key, value in sections.items():
        spec[key] = {**spec[key], **value}
    return spec


def write_rows(path: str, num_rows: int, marker: str | None, every: int = 100, options: dict | None = None) -> int:
    """num_rows prompts; every `every`-th row (from row 37) says `marker`. Returns how many do."""
    import fsspec

    marked = [marker is not None and i % every == 37 % every for i in range(num_rows)]
    prompts = [f"{marker} row {i}" if m else f"question {i} about things" for i, m in enumerate(marked)]
    with fsspec.open(path, "wb", **(options or {})) as f:
        pq.write_table(pa.table({"id": [f"r{i:05d}" for i in range(num_rows)], "prompt": prompts}), f,
                       row_group_size=1000)
    return sum(marked)


def run(spec: dict) -> tuple[object, float]:
    from jobrunner.driver.job import run_job
    from jobrunner.spec import spec_from_dict

    started = time.monotonic()
    result = run_job(spec_from_dict(spec), show_progress=False)
    return result, time.monotonic() - started


def isolation_of(manifest: dict) -> dict:
    runs = manifest.get("runs") or [{}]
    return runs[-1].get("isolation") or {}


def error_rows(output_url: str, options: dict | None = None) -> dict:
    from jobrunner.io.parts import read_output

    table = read_output(output_url, options) if options else read_output(output_url)
    return {r["id"]: r["error"] for r in table.select(["id", "error"]).to_pylist() if r["error"]}


def scenario_stall(tmp: Path) -> dict:
    write_rows(str(tmp / "in.parquet"), 200, "STALL", every=1000)
    spec = spec_dict(str(tmp / "in.parquet"), str(tmp / "out"),
                     engine={"factory_options": {"stall_on": "STALL"}},
                     cluster={"num_workers": 1, "progress_timeout_s": DEADLINE_S})
    result, wall = run(spec)
    errors = error_rows(str(tmp / "out"))
    suspects = 2 * 16  # at most 2 x max_num_seqs rows in the engine when it stalls
    bound = (math.ceil(math.log2(suspects)) + 2) * DEADLINE_S
    return {"scenario": "stall", "wall_s": round(wall, 1), "isolating_bound_s": bound,
            "committed": result.manifest["totals"]["shards_committed"], "error_rows": len(errors),
            "error": next(iter(errors.values()), None), "isolation": isolation_of(result.manifest)}


class HangingS3Proxy:
    """Forwards S3 requests to a real server, except those `hangs(method, path)` picks: never answered."""

    def __init__(self, upstream: str, hangs) -> None:
        self.upstream, self.hangs, self.stop = upstream.split("//", 1)[1], hangs, threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy.hangs(self.command, self.path):
                    proxy.stop.wait()  # a storage call that never answers
                    return
                conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "expect")}
                conn.request(self.command, self.path, body=body, headers=headers)
                reply = conn.getresponse()
                data = reply.read()
                self.send_response(reply.status)
                head = self.command == "HEAD"  # keeps the object's Content-Length, sends no body
                for key, value in reply.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection") and (head or key.lower() !=
                                                                                  "content-length"):
                        self.send_header(key, value)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()


def _s3(endpoint: str) -> dict:
    return {"key": "testing", "secret": "testing", "endpoint_url": endpoint}


def scenario_io_hang(tmp: Path, moto_url: str, phase: str) -> dict:
    import boto3

    bucket = f"hang-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=moto_url, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=bucket)
    write_rows(f"s3://{bucket}/in/in.parquet", 200, None, options=_s3(moto_url))
    started = {"job": False}

    def hangs(method: str, path: str) -> bool:
        if method == "PUT" and path.split("?")[0].endswith("/_manifest.json"):
            started["job"] = True  # planning is over: the job has written its manifest
        if phase == "read":
            return started["job"] and method == "GET" and "/in/in.parquet" in path
        return method == "PUT" and "/_temporary/" in path and "/part-" in path

    proxy = HangingS3Proxy(moto_url, hangs)
    try:
        opts = _s3(proxy.url)
        spec = spec_dict(f"s3://{bucket}/in/", f"s3://{bucket}/out", opts,
                         cluster={"num_workers": 1, "io_timeout_s": DEADLINE_S, "max_shard_attempts": 2})
        result, wall = run(spec)
    finally:
        proxy.close()
    attempts = 2
    return {"scenario": f"{phase}-hang", "wall_s": round(wall, 1), "deadlines_s": attempts * DEADLINE_S,
            "ok": result.ok, "failed_shards": len(result.failed), "error": next(iter(result.failed.values()), None)}


def scenario_poison(tmp: Path, num_rows: int, baseline: bool) -> list[dict]:
    out = []
    for marker in ([None] if baseline else []) + ["POISON"]:
        name = marker or "clean"
        num_marked = write_rows(str(tmp / f"{name}.parquet"), num_rows, marker)
        spec = spec_dict(str(tmp / f"{name}.parquet"), str(tmp / f"out-{name}"),
                         engine={"factory_options": {"fail_on": "POISON", "load_delay_s": 0.5}},
                         cluster={"max_worker_restarts": 1000})
        result, wall = run(spec)
        manifest = result.manifest
        errors = error_rows(str(tmp / f"out-{name}"))
        workers = manifest["workers"]
        rebuilds = isolation_of(manifest).get("engine_rebuilds",
                                               sum(int(w.get("engine_rebuilds") or 0) for w in workers.values()))
        line = {"scenario": "poison" if marker else "poison-baseline", "rows": num_rows, "poison_rows": num_marked,
                "rows_isolated": len(errors), "model_loads": len(workers), "engine_rebuilds": rebuilds,
                "wall_s": round(wall, 1), "shards_failed": manifest["totals"]["shards_failed"],
                "all_rows_once": manifest["totals"]["rows"] == num_rows}
        if errors:
            first_workers = min(2, math.ceil(num_rows / 1000))  # the pool's start: not isolation's cost
            line.update(model_loads_per_isolated_row=round((len(workers) - first_workers) / len(errors), 2),
                        wall_per_isolated_row_s=round(wall / len(errors), 2),
                        isolation=isolation_of(manifest))
        out.append(line)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["stall", "read-hang", "write-hang", "poison"], action="append")
    parser.add_argument("--rows", type=int, default=10_000, help="rows of the poison scenario")
    parser.add_argument("--baseline", action="store_true", help="also run the poison scenario without poison")
    args = parser.parse_args()
    wanted = args.only or ["stall", "read-hang", "write-hang", "poison"]
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    moto = None
    if {"read-hang", "write-hang"} & set(wanted):
        from moto.server import ThreadedMotoServer

        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        moto.start()
    try:
        for name in wanted:
            with tempfile.TemporaryDirectory() as tmp:
                if name == "stall":
                    lines = [scenario_stall(Path(tmp))]
                elif name == "poison":
                    lines = scenario_poison(Path(tmp), args.rows, args.baseline)
                else:
                    host, port = moto.get_host_and_port()
                    lines = [scenario_io_hang(Path(tmp), f"http://{host}:{port}", name.split("-")[0])]
            for line in lines:
                print(json.dumps(line), flush=True)
    finally:
        if moto is not None:
            moto.stop()
        ray.shutdown()


if __name__ == "__main__":
    main()
