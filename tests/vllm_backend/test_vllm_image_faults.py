"""The row guarantees with images through engine.backend vllm (real Ray, vLLM's CPU build, the tiny SmolVLM): an
image row that kills the vLLM process is isolated as that row's error while the other image rows of its shard
commit, and a row whose image is missing is its own error. Heavy: two vLLM starts (~2 min)."""

from __future__ import annotations

import base64
import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobrunner.driver.job import run_job
from jobrunner.io.parts import read_output
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import read_manifest_file
from tests.vision_helpers import make_test_image
from tests.vllm_backend.test_vllm_faults import _poison_python
from tests.vllm_backend.vllm_python import vllm_python_or_skip
from tests.vllm_backend.vlm_dirs import build_vllm_smolvlm

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(1200)]


def _data_url(seed: int) -> str:
    buffer = io.BytesIO()
    make_test_image(40, 30, seed).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_an_image_row_that_kills_vllm_is_isolated(local_ray, tmp_path):
    python = _poison_python(tmp_path, vllm_python_or_skip())  # a prompt whose ids decode to POISON kills vLLM
    model_dir = build_vllm_smolvlm(tmp_path / "smolvlm")
    ids = [f"v{i:02d}" for i in range(5)]
    prompts = ["Describe the picture in one sentence."] * 5
    prompts[2] = "Say POISON about the picture."
    images = [[_data_url(i)] for i in range(5)]
    images[4] = ["images/missing.png"]  # relative to the input file's folder
    pq.write_table(pa.table({"id": ids, "prompt": prompts, "image": images}), tmp_path / "in.parquet")
    spec = spec_from_dict({
        "name": "vllm-image-faults", "model": {"source": str(model_dir), "dtype": "float32"},
        "input": {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt", "image_column": "image",
                  "id_column": "id", "rows_per_shard": 5},
        "sampling": {"max_tokens": 6, "temperature": 0.0},
        "engine": {"backend": "vllm", "vllm_python": python, "max_num_seqs": 8, "max_model_len": 1024},
        "output": {"url": str(tmp_path / "out"), "max_error_rate": 1.0},
        "cluster": {"num_workers": 1, "num_cpus_per_worker": 1, "retry_backoff_s": 0.2}})
    result = run_job(spec, show_progress=False)
    assert result.ok, result.summary()
    rows = {r["id"]: r for r in read_output(str(tmp_path / "out")).to_pylist()}
    assert sorted(rows) == ids
    assert rows["v02"]["finish_reason"] == "error" and "vLLM engine process exited" in rows["v02"]["error"]
    assert rows["v04"]["error"] == "row v04: image 1 of 1 (images/missing.png, image_column 'image'[0]): not found"
    for i in ("v00", "v01", "v03"):
        assert rows[i]["error"] is None and rows[i]["num_output_tokens"] > 0, rows[i]
        assert rows[i]["num_images"] == 1 and rows[i]["num_image_tokens"] > 0
    isolation = read_manifest_file(tmp_path / "out")["runs"][-1]["isolation"]
    assert isolation["rows_isolated"] == 1 and isolation["engine_rebuilds"] >= 1, isolation
