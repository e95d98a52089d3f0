"""The driver's guarantees with engine.backend vllm, for real (Ray, vLLM's CPU build): a row that kills the vLLM
process is isolated as an error row while the rest of its shard commits (with a JSON schema that every other row
meets), and a driver killed mid-job is resumed by the same command without recomputing a committed shard."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from jobrunner.driver.job import run_job
from jobrunner.io.manifest import read_manifest_with_records
from jobrunner.io.parts import read_output
from jobrunner.io.storage import Storage
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import REPO, read_manifest_file
from tests.vllm_backend.vllm_python import vllm_python_or_skip

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Run by the vLLM venv's Python in place of server.py: the real server, except that a request whose prompt
# decodes to text containing POISON makes the next engine step kill the process (as a crash in a kernel would).
POISON_SERVER = """
import os, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import server

real_start, real_add, real_step = server.Server.start, server.Server.add, server.Server.step
poisoned = set()

def start(self, engine_args, placement=None):
    from transformers import AutoTokenizer
    self.test_tokenizer = AutoTokenizer.from_pretrained(engine_args["model"])
    return real_start(self, engine_args, placement)

def add(self, message):
    if "POISON" in self.test_tokenizer.decode(message["prompt_token_ids"]):
        poisoned.add(message["id"])
    return real_add(self, message)

def step(self):
    if poisoned:
        os._exit(17)
    return real_step(self)

server.Server.start, server.Server.add, server.Server.step = start, add, step
sys.exit(server.main())
"""


def _poison_python(tmp_path, python: str) -> str:
    """A 'python' for engine.vllm_python: the real one for every probe (-c ...), the poisoned server for
    server.py."""
    (tmp_path / "poison_server.py").write_text(POISON_SERVER)
    wrapper = tmp_path / "vllm-python"
    wrapper.write_text(f'#!/bin/sh\nif [ "$1" = "-c" ]; then exec {python} "$@"; fi\n'
                       f'exec {python} {tmp_path / "poison_server.py"} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def _prompts(path, n: int, poison: int | None = None) -> list[str]:
    ids = [f"v{i:02d}" for i in range(n)]
    texts = ["Say POISON and stop." if i == poison else f"Count from 1 to {i + 3}." for i in range(n)]
    pq.write_table(pa.table({"id": ids, "prompt": texts}), path)
    return ids


def _spec(tmp_path, python: str, rows_per_shard: int, **extra) -> dict:
    data = {"name": "vllm-faults", "model": {"source": "smollm2-135m-instruct", "dtype": "float32"},
            "input": {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt", "id_column": "id",
                      "messages_column": None, "rows_per_shard": rows_per_shard},
            "sampling": {"max_tokens": 24, "temperature": 0.0},
            "engine": {"backend": "vllm", "vllm_python": python, "max_num_seqs": 8, "max_model_len": 512},
            "output": {"url": str(tmp_path / "out"), "max_error_rate": 1.0},
            "cluster": {"num_workers": 1, "num_cpus_per_worker": 1, "retry_backoff_s": 0.2}}
    for section, values in extra.items():
        data[section] = {**data.get(section, {}), **values}
    return data


def test_a_row_that_kills_vllm_is_isolated(local_ray, tmp_path):
    """Also a JSON schema through vLLM's structured outputs: every row that ran is valid for it."""
    python = _poison_python(tmp_path, vllm_python_or_skip())
    ids = _prompts(tmp_path / "in.parquet", 4, poison=2)
    schema = {"type": "string", "enum": ["yes", "no"]}
    data = _spec(tmp_path, python, 4, sampling={"json_schema": schema})
    result = run_job(spec_from_dict(data), show_progress=False)
    assert result.ok, result.summary()
    rows = {r["id"]: r for r in read_output(str(tmp_path / "out")).to_pylist()}
    assert sorted(rows) == ids
    assert rows["v02"]["finish_reason"] == "error" and "vLLM engine process exited" in rows["v02"]["error"]
    assert all(rows[i]["finish_reason"] in ("stop", "length") and rows[i]["num_output_tokens"] > 0
               for i in ids if i != "v02")
    assert all(rows[i]["json_valid"] is True and rows[i]["generated_text"].strip() in ('"yes"', '"no"')
               for i in ids if i != "v02")
    isolation = read_manifest_file(tmp_path / "out")["runs"][-1]["isolation"]
    # the worker closed the dead vLLM process and started another (an engine rebuild) for each crash
    assert isolation["rows_isolated"] == 1 and isolation["engine_rebuilds"] >= 1, isolation


def _committed(out) -> dict:
    try:
        manifest = read_manifest_with_records(Storage(str(out)))
    except (OSError, ValueError):
        return {}
    return {s: e for s, e in ((manifest or {}).get("shards") or {}).items() if e["status"] == "committed"}


# heavy: a killed driver resumed without recomputing is held on every engine by tests/driver/test_faults.py
@pytest.mark.heavy
def test_a_killed_driver_is_resumed_without_recomputing(local_ray, tmp_path):
    import ray

    python = vllm_python_or_skip()
    ids = _prompts(tmp_path / "in.parquet", 8)
    data = _spec(tmp_path, python, 2, output={"lease_ttl_s": 120.0}, sampling={"max_tokens": 40})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    address = ray.get_runtime_context().gcs_address
    driver = subprocess.Popen([sys.executable, "-c", "from jobrunner.cli import main; main()", "run",
                               str(tmp_path / "job.yaml"), "--address", address, "--no-progress", "--no-report"],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while len(_committed(out)) < 1 and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.2)
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    before = _committed(out)
    assert 1 <= len(before) < 4, f"{len(before)} shards committed when the driver was killed"
    mtimes = {s: (out / e["part"]).stat().st_mtime_ns for s, e in before.items()}
    result = run_job(spec_from_dict(data), show_progress=False)  # the same job again, at once
    assert result.ok, result.summary()
    rows = read_output(str(out)).to_pylist()
    assert sorted(r["id"] for r in rows) == ids  # every row once
    assert all(r["finish_reason"] in ("stop", "length") for r in rows)
    after = read_manifest_file(out)
    assert after["run_count"] == 2 and after["model"]["backend"] == "vllm"
    for shard_id, entry in before.items():
        assert (out / entry["part"]).stat().st_mtime_ns == mtimes[shard_id], f"{shard_id} recomputed"
