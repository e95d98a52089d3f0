"""Helpers for driver, fault and CLI tests: prompt files, fake-engine job specs, buckets, manifests."""

import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[2]
FAKE = "tests.driver.fake_engine:make_engine"


def write_prompts(path, n: int, row_group_size: int = 8, storage_options=None,
                  poison: int | None = None) -> list:
    """A prompt Parquet file of n rows (ids p000...); row `poison` says POISON. Returns the ids."""
    import fsspec

    ids = [f"p{i:03d}" for i in range(n)]
    prompts = ["POISON row" if i == poison else f"question {i} about things" for i in range(n)]
    table = pa.table({"id": ids, "prompt": prompts, "topic": [f"t{i % 3}" for i in range(n)]})
    with fsspec.open(str(path), "wb", **(storage_options or {})) as f:
        pq.write_table(table, f, row_group_size=row_group_size)
    return ids


def fake_spec(input_url: str, output_url: str, storage_options=None, **sections) -> dict:
    """A job spec dict on the fake engine; `sections` deep-update it (e.g. cluster={...})."""
    opts = storage_options or {}
    spec = {"name": "fake-job",
            "input": {"url": input_url, "prompt_column": "prompt", "id_column": "id", "rows_per_shard": 8,
                      "storage_options": opts},
            "sampling": {"max_tokens": 4},
            "engine": {"max_num_seqs": 4, "factory": FAKE, "factory_options": {}},
            "cluster": {"num_workers": 2, "num_cpus_per_worker": 0.5, "retry_backoff_s": 0.1},
            "output": {"url": output_url, "mode": "resume", "storage_options": opts,
                       "keep_columns": ["topic"]}}
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value}
    return spec


def read_manifest_file(path) -> dict:
    """The manifest with its shards as `{shard_id: entry}` (the shard table expanded, records folded)."""
    from jobrunner.io.manifest import read_manifest_with_records
    from jobrunner.io.storage import Storage

    return read_manifest_with_records(Storage(str(path)))


def new_bucket(s3_server) -> str:
    import boto3

    bucket = f"t-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_server["endpoint_url"], aws_access_key_id="testing",
                 aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=bucket)
    return bucket


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held together while chosen, so they differ)."""
    import socket

    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def planned(spec):
    """`(plan, previous)` as `run_job` makes them: the output read once, then the input planned against it;
    `open_output(spec, *planned(spec))` and `describe_output(spec, *planned(spec))` take both."""
    from jobrunner.driver.output import read_previous_output
    from jobrunner.driver.plan import plan_job

    previous = read_previous_output(spec)
    return plan_job(spec, previous.header), previous
