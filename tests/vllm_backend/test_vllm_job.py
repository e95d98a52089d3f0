"""A whole job through engine.backend vllm on the embedded model (Ray, real vLLM): every row once, the metric
columns filled, n samples, a bad row as an error row, the backend and its version in the manifest and report,
and a rerun that recomputes nothing."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobrunner.driver.job import run_job
from jobrunner.io.parts import read_output
from jobrunner.spec import load_spec
from tests.driver.helpers import REPO, read_manifest_file
from tests.vllm_backend.vllm_python import vllm_python_or_skip

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_example_rows_through_vllm(local_ray, tmp_path):
    python = vllm_python_or_skip()
    sample = pq.read_table(REPO / "examples" / "data" / "prompts.parquet").slice(0, 6)
    messages = sample.column("messages").to_pylist()
    messages[2] = []  # a bad row: an error row, the shard still commits
    table = sample.set_column(sample.schema.get_field_index("messages"), "messages",
                              pa.array(messages, sample.schema.field("messages").type))
    pq.write_table(table, tmp_path / "six.parquet")
    spec = load_spec(REPO / "jobs" / "example.yaml", [
        f"input.url={tmp_path / 'six.parquet'}", "input.rows_per_shard=3", "sampling.max_tokens=12",
        "sampling.n=2", "sampling.temperature=0.8", "sampling.seed=5", "model.dtype=float32",
        "engine.backend=vllm", f"engine.vllm_python={python}", "engine.max_model_len=1024",
        f"output.url={tmp_path / 'out'}", "cluster.num_cpus_per_worker=1"])
    result = run_job(spec, show_progress=False)
    assert result.ok, result.summary()
    rows = read_output(str(tmp_path / "out")).to_pylist()
    ids = sample.column("id").to_pylist()
    expected = [(i, k) for i in ids if i != ids[2] for k in (0, 1)] + [(ids[2], 0)]  # a bad row: one error row
    assert sorted((r["id"], r["sample_index"]) for r in rows) == sorted(expected)
    bad = [r for r in rows if r["id"] == ids[2]]
    assert all(r["finish_reason"] == "error" and "messages column" in r["error"] for r in bad)
    good = [r for r in rows if r["id"] != ids[2]]
    assert all(r["finish_reason"] in ("stop", "length") and 0 < r["num_output_tokens"] <= 12 for r in good)
    assert all(r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"] and r["queue_s"] >= 0 for r in good)
    assert all(r["num_prompt_tokens"] > 0 for r in good)
    manifest = read_manifest_file(tmp_path / "out")
    assert manifest["model"]["backend"] == "vllm" and manifest["model"]["vllm_version"]
    assert manifest["spec"]["engine"]["backend"] == "vllm"
    worker = manifest["workers"]["w0"]
    assert worker["num_output_tokens"] == sum(r["num_output_tokens"] for r in good)
    assert "engine" in worker["startup_stages_s"]
    # a rerun of the committed output computes nothing
    again = run_job(spec, show_progress=False)
    assert again.ok and read_manifest_file(tmp_path / "out")["run_count"] == 2
    assert len(read_output(str(tmp_path / "out")).to_pylist()) == len(rows)
