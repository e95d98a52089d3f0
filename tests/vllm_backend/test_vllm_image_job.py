"""Issue 49's image job through engine.backend vllm (real Ray, vLLM's CPU build, the S3 test server, the tiny
random SmolVLM with head_dim 32): the same 30 answers and 2 error rows naming their image as on our engine, and
the same greedy texts row by row. Heavy: a vLLM start and our engine's run of the same job, ~2 min."""

from __future__ import annotations

import pytest

from jobrunner.driver.job import run_job
from tests.driver.image_job_data import CORRUPT_ROW, MISSING_ROW, check_rows, image_job
from tests.vllm_backend.vllm_python import vllm_python_or_skip
from tests.vllm_backend.vlm_dirs import build_vllm_smolvlm

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(1200)]


def test_the_image_job_through_vllm_gives_our_engines_texts(local_ray, s3_server, tmp_path):
    python = vllm_python_or_skip()
    model_dir = build_vllm_smolvlm(tmp_path / "smolvlm")
    theirs_spec, _, _ = image_job(s3_server, tmp_path / "vllm", model_dir, backend="vllm", vllm_python=python)
    result = run_job(theirs_spec, show_progress=False)
    assert result.ok, result.summary()
    theirs = check_rows(theirs_spec.output.url)
    ours_spec, _, _ = image_job(s3_server, tmp_path / "ours", model_dir)
    assert run_job(ours_spec, show_progress=False).ok
    ours = check_rows(ours_spec.output.url)
    answered = sorted(set(ours) - {CORRUPT_ROW, MISSING_ROW})
    assert len(answered) == 30
    different = [i for i in answered if theirs[i]["generated_text"] != ours[i]["generated_text"]]
    assert different == [], {i: (theirs[i]["generated_text"], ours[i]["generated_text"]) for i in different}
    for i in answered:
        assert theirs[i]["num_prompt_tokens"] == ours[i]["num_prompt_tokens"], i
        assert theirs[i]["num_output_tokens"] == ours[i]["num_output_tokens"], i
        assert theirs[i]["num_image_tokens"] == ours[i]["num_image_tokens"], i
    # the error rows name the same image on both backends: images are read by the worker, not the engine
    assert {i: theirs[i]["error"] for i in (CORRUPT_ROW, MISSING_ROW)} == \
        {i: ours[i]["error"] for i in (CORRUPT_ROW, MISSING_ROW)}
    assert len({theirs[i]["generated_text"] for i in answered}) >= 3  # the images matter to the texts
