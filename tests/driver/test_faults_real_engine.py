"""The driver's kill -9 + rerun and poison-row guarantees once on OUR engine (the fake engine runs them all in
test_faults.py / test_job_local.py): a tiny random Llama (tests/conftest.py) through LLMEngine, its faults
injected at the engine's step (tests/driver/real_engine.py). Every row's text is the engine's own greedy text
for that prompt outside the driver: a crash, a rebuild or a rerun changed none of them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import ray
import yaml

from jobrunner.driver.job import run_job
from jobrunner.engine import EngineConfig, LLMEngine, SamplingParams
from jobrunner.io.manifest import read_manifest_with_records
from jobrunner.io.parts import read_output
from jobrunner.io.storage import Storage
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import REPO, read_manifest_file, write_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SAMPLING = {"max_tokens": 6, "temperature": 0.0}


def _spec(tmp_path, model_dir, n_rows: int, poison: int | None = None, **options) -> tuple[list[str], dict]:
    ids = write_prompts(tmp_path / "in.parquet", n_rows, row_group_size=4, poison=poison)
    data = {"name": "real-faults",
            "model": {"source": str(model_dir), "dtype": "float32"},
            "input": {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt", "id_column": "id",
                      "rows_per_shard": 4, "prefix_grouping": "off"},
            "sampling": SAMPLING,
            "engine": {"max_num_seqs": 4, "num_kv_blocks": 64, "factory": "tests.driver.real_engine:make_engine",
                       "factory_options": options},
            "cluster": {"num_workers": 1, "num_cpus_per_worker": 1, "retry_backoff_s": 0.1},
            "output": {"url": str(tmp_path / "out"), "mode": "resume"}}
    return ids, data


def _expected_texts(model_dir, tmp_path) -> dict[str, str]:
    """Each row's greedy text from our engine alone (no driver, no fault)."""
    rows = pq.read_table(tmp_path / "in.parquet").to_pylist()
    engine = LLMEngine.from_source(str(model_dir), dtype="float32", config=EngineConfig(device="cpu", num_kv_blocks=64))
    outputs = engine.generate([r["prompt"] for r in rows], SamplingParams(**SAMPLING))
    return {r["id"]: o.text for r, o in zip(rows, outputs, strict=True)}


def _committed(out) -> dict:
    try:
        manifest = read_manifest_with_records(Storage(str(out)))
    except (OSError, ValueError):
        return {}
    return {s: e for s, e in ((manifest or {}).get("shards") or {}).items() if e["status"] == "committed"}


# heavy: a driver process of its own and two worker loads (55 s beside 8 engineers' work); the fake engine's
# version (test_faults.py) holds the guarantee in the default suite
@pytest.mark.heavy
def test_killed_driver_then_rerun_on_our_engine(local_ray, tiny_llama_hf_dir, tmp_path):
    """kill -9 of the driver once a shard is committed (the worker then holds until the kill is done), the same
    job again at once: the committed shards are not recomputed, every row is there once, with our engine's text."""
    go, out = tmp_path / "go", tmp_path / "out"
    ids, data = _spec(tmp_path, tiny_llama_hf_dir, 16, hold_file=str(go), hold_after=4)
    data["output"]["lease_ttl_s"] = 120.0  # the rerun takes over because the killed pid is gone, not by the ttl
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(data))
    cmd = [sys.executable, "-c", "from jobrunner.cli import main; main()", "run", str(tmp_path / "job.yaml"),
           "--address", ray.get_runtime_context().gcs_address, "--no-progress", "--no-report"]
    driver = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not _committed(out) and driver.poll() is None:
            assert time.monotonic() < deadline, "no shard committed"
            time.sleep(0.1)
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    before = _committed(out)
    assert len(before) == 1, before  # the worker holds after its first shard's 4 rows
    mtimes = {s: (out / e["part"]).stat().st_mtime_ns for s, e in before.items()}
    go.touch()
    result = run_job(spec_from_dict(data), show_progress=False)
    assert result.ok, result.summary()
    rows = {r["id"]: r for r in read_output(str(out)).to_pylist()}
    assert sorted(rows) == ids and read_output(str(out)).num_rows == len(ids)
    assert {i: r["generated_text"] for i, r in rows.items()} == _expected_texts(tiny_llama_hf_dir, tmp_path)
    after = read_manifest_file(out)
    for shard_id, entry in before.items():
        assert (out / entry["part"]).stat().st_mtime_ns == mtimes[shard_id], f"{shard_id} recomputed"
        assert after["shards"][shard_id]["worker_id"] == entry["worker_id"]
    assert (out / "_SUCCESS").exists() and json.loads((out / "_manifest.json").read_text())["run_count"] == 2


def test_a_poison_row_is_isolated_on_our_engine(local_ray, tiny_llama_hf_dir, tmp_path):
    """A row that crashes our engine's step becomes its error row; our engine is rebuilt in the worker (no model
    load, no worker restart) and its neighbours, rerun one by one, give the engine's own text."""
    out = tmp_path / "out"
    ids, data = _spec(tmp_path, tiny_llama_hf_dir, 12, poison=5, fail_on="POISON")
    result = run_job(spec_from_dict(data), show_progress=False)
    rows = {r["id"]: r for r in read_output(str(out)).to_pylist()}
    assert sorted(rows) == ids
    assert rows["p005"]["error"] == "engine crashed on this row: RuntimeError: injected engine crash ('POISON' in " \
        "the step)"
    expected = _expected_texts(tiny_llama_hf_dir, tmp_path)
    assert {i: r["generated_text"] for i, r in rows.items() if i != "p005"} == \
        {i: t for i, t in expected.items() if i != "p005"}
    manifest = read_manifest_file(out)
    cost = manifest["runs"][-1]["isolation"]
    assert cost["engine_rebuilds"] >= 1 and cost["model_loads"] == 0 and cost["rows_isolated"] == 1
    assert set(manifest["workers"]) == {"w0"} and manifest["totals"]["num_errors"] == 1
    assert result.ok, result.summary()  # 1 error row in 12: within output.max_error_rate's default 0.1
