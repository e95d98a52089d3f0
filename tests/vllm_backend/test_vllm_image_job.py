"""Issue 49's image job through engine.backend vllm (real Ray, vLLM's CPU build, the S3 test server, the tiny
random SmolVLM with head_dim 32): the same 30 answers and 2 error rows naming their image as on our engine, and
the same greedy tokens (and texts) row by row. Heavy: a vLLM start and our engine's run of the same job, ~2 min."""

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
    logprobs = {"logprobs": 0}  # each output token's id comes back with its log-probability
    theirs_spec, _, _ = image_job(s3_server, tmp_path / "vllm", model_dir, logprobs, backend="vllm",
                                  vllm_python=python)
    result = run_job(theirs_spec, show_progress=False)
    assert result.ok, result.summary()
    theirs = check_rows(theirs_spec.output.url)
    ours_spec, _, _ = image_job(s3_server, tmp_path / "ours", model_dir, logprobs)
    assert run_job(ours_spec, show_progress=False).ok
    ours = check_rows(ours_spec.output.url)
    answered = sorted(set(ours) - {CORRUPT_ROW, MISSING_ROW})
    assert len(answered) == 30
    for i in answered:
        assert _token_ids(theirs[i]) == _token_ids(ours[i]), i  # the same greedy tokens
        assert theirs[i]["num_prompt_tokens"] == ours[i]["num_prompt_tokens"], i
        assert theirs[i]["num_image_tokens"] == ours[i]["num_image_tokens"] > 0, i
        assert theirs[i]["num_images"] == ours[i]["num_images"], i
    # the same texts, but for bytes that are no whole UTF-8 character (a random model's byte tokens): ours
    # decodes them as U+FFFD as transformers' decode does, vLLM's detokenizer holds an unfinished one back
    whole = [i for i in answered if "\ufffd" not in ours[i]["generated_text"]]
    assert len(whole) >= 5 and all(theirs[i]["generated_text"] == ours[i]["generated_text"] for i in whole)
    print(f"{len(answered)} rows: tokens equal; {len(whole)} texts of whole characters equal")
    # the error rows say the same on both backends (images are read by the worker, not the engine); each job
    # has its own bucket and folder, named in the image's source
    assert [theirs[i]["error"].split("): ")[1] for i in (CORRUPT_ROW, MISSING_ROW)] == \
        [ours[i]["error"].split("): ")[1] for i in (CORRUPT_ROW, MISSING_ROW)]
    assert len({tuple(_token_ids(theirs[i])) for i in answered}) >= 3  # the images matter to the tokens


def _token_ids(row: dict) -> list[int]:
    return [entry["token_id"] for entry in row["logprobs"]]
