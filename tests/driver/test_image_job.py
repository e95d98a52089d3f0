"""Issue 49's job target on our engine (real Ray, the S3 test server, the tiny random SmolVLM): 32 rows whose
images are data URLs, local files and s3:// keys, one corrupt and one missing: 30 answers, 2 error rows naming
the image, every id once; rows checked against transformers' own generate; a rerun in resume mode recomputes
nothing; (heavy) a shard lost after its part was published is rerun by the resume without a duplicate row. And
an OpenAI batch file with image parts runs and its output lines parse with the openai package's types."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from jobrunner.driver.job import run_job
from jobrunner.io.parts import read_output
from jobrunner.spec import spec_from_dict
from tests.driver.image_job_data import NUM_ROWS, check_rows, image_job, row_prompt
from tests.vllm_backend.vlm_dirs import build_vllm_smolvlm, hf_generate

pytestmark = pytest.mark.timeout(900)
CHECKED_ROWS = (0, 4, 12, 14, 27)  # a data URL, data URL + local, a local file, local + s3, an s3 key


@pytest.fixture(scope="module")
def smolvlm_dir(tmp_path_factory):
    """The tiny SmolVLM with head_dim 32 (the shape vLLM's CPU build also runs: the same model for both)."""
    return build_vllm_smolvlm(tmp_path_factory.mktemp("smolvlm"))


def _uncommit_shard(fs, out: str, shard_index: int) -> str:
    """Mark one committed shard pending in the output's shard table, its part left in place (a driver that
    died between publishing the part and recording it); returns that shard's id."""
    manifest = json.loads(fs.cat_file(f"{out}/_manifest.json"))
    key = f"{out}/{manifest['shard_table']['key']}"
    with fs.open(key, "rb") as f:
        table = pq.read_table(f)
    shard_id = table.column("shard_id")[shard_index].as_py()
    lost = pc.equal(pc.cast(table.column("shard_id"), pa.string()), shard_id)
    status = pc.if_else(lost, "pending", pc.cast(table.column("status"), pa.string()))
    with fs.open(key, "wb") as f:
        pq.write_table(table.set_column(table.schema.get_field_index("status"), "status", status), f)
    if fs.exists(f"{out}/_SUCCESS"):
        fs.rm(f"{out}/_SUCCESS")
    return shard_id


def test_the_image_job_answers_30_rows_and_names_2_bad_images(local_ray, s3_server, tmp_path, smolvlm_dir):
    spec, _, _ = image_job(s3_server, tmp_path, smolvlm_dir)
    result = run_job(spec, show_progress=False)
    assert result.ok, result.summary()
    assert result.manifest["totals"]["rows"] == NUM_ROWS and result.manifest["totals"]["num_errors"] == 2
    by_id = check_rows(spec.output.url)
    reference = hf_generate(smolvlm_dir, [row_prompt(i) for i in CHECKED_ROWS], spec.sampling.max_tokens)
    tokenizer = AutoTokenizer.from_pretrained(str(smolvlm_dir))
    for i, (prompt_ids, output_ids) in zip(CHECKED_ROWS, reference, strict=True):
        row = by_id[f"row-{i:02d}"]
        assert row["num_prompt_tokens"] == len(prompt_ids), f"row {i}"
        assert row["num_output_tokens"] == len(output_ids), f"row {i}"
        assert row["generated_text"] == tokenizer.decode(output_ids, skip_special_tokens=True), f"row {i}"
    texts = {i: r["generated_text"] for i, r in by_id.items()}
    # the same command again (resume mode): every shard is committed, nothing is computed or written twice
    again = run_job(spec, show_progress=False)
    assert again.ok and again.manifest["runs"][-1]["rows_committed"] == 0
    assert {i: r["generated_text"] for i, r in check_rows(spec.output.url).items()} == texts


@pytest.mark.heavy  # two more worker starts (~35 s): the default suite's test above runs the job and its rerun
def test_a_shard_lost_after_its_part_was_published_is_rerun_once(local_ray, s3_server, tmp_path, smolvlm_dir):
    import fsspec

    spec, _, _ = image_job(s3_server, tmp_path, smolvlm_dir)
    assert run_job(spec, show_progress=False).ok
    texts = {i: r["generated_text"] for i, r in check_rows(spec.output.url).items()}
    lost = _uncommit_shard(fsspec.filesystem("file"), spec.output.url, 1)
    resumed = run_job(spec, show_progress=False)
    assert resumed.ok, resumed.summary()
    run = resumed.manifest["runs"][-1]
    assert run["shards_committed"] == 1 and 0 < run["rows_committed"] < 32, (lost, run)
    assert {i: r["generated_text"] for i, r in check_rows(spec.output.url).items()} == texts


def _batch_line(custom_id: str, parts: list[dict] | str) -> str:
    body = {"model": "tiny-smolvlm", "messages": [{"role": "user", "content": parts}], "max_tokens": 6,
            "temperature": 0}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


@pytest.mark.heavy  # a worker start (~15-20 s); the worker's own test of image parts in batch lines is default
def test_an_openai_batch_file_with_image_parts_runs_and_its_output_parses(local_ray, tmp_path, smolvlm_dir):
    import base64

    from openai.types.chat import ChatCompletion

    from tests.driver.image_job_data import png_bytes
    from tests.vision_helpers import image_prompt

    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "cat.png").write_bytes(png_bytes(3))
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes(1)).decode()
    text = {"type": "text", "text": "Describe the picture in one sentence."}
    lines = [_batch_line("a", [{"type": "image_url", "image_url": {"url": data_url}}, text]),
             _batch_line("b", [{"type": "image_url", "image_url": {"url": "images/cat.png", "detail": "low"}},
                               {"type": "image_url", "image_url": {"url": data_url}}, text]),
             _batch_line("c", "The cat sat on the mat."),
             _batch_line("d", [text, {"type": "image_url", "image_url": {"url": "images/missing.png"}}])]
    (tmp_path / "batch.jsonl").write_text("\n".join(lines) + "\n")
    spec = spec_from_dict({"name": "batch-images", "model": {"source": str(smolvlm_dir), "dtype": "float32"},
                           "input": {"url": str(tmp_path / "batch.jsonl"), "format": "openai_batch",
                                     "openai_model_mismatch": "warn"},
                           "engine": {"max_num_seqs": 4, "max_model_len": 1024},
                           "cluster": {"num_workers": 1, "num_cpus_per_worker": 1, "retry_backoff_s": 0.1},
                           "output": {"url": str(tmp_path / "out"), "max_error_rate": 0.5}})
    result = run_job(spec, show_progress=False)
    assert result.ok, result.summary()
    out_lines = [json.loads(x) for x in (tmp_path / "out" / "_openai" / "output.jsonl").read_text().splitlines()]
    err_lines = [json.loads(x) for x in (tmp_path / "out" / "_openai" / "errors.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out_lines] == ["a", "b", "c"] and [e["custom_id"] for e in err_lines] == ["d"]
    chats = {o["custom_id"]: ChatCompletion.model_validate(o["response"]["body"]) for o in out_lines}
    rows = {r["id"]: r for r in read_output(spec.output.url).to_pylist()}
    for cid, chat in chats.items():
        assert chat.object == "chat.completion" and chat.choices[0].message.content == rows[cid]["generated_text"]
        assert chat.usage.prompt_tokens == rows[cid]["num_prompt_tokens"]
    assert [rows[c]["num_images"] for c in "abc"] == [1, 2, 0]
    # the image's tokens count as prompt tokens, as transformers' processor expands them
    (reference_ids, reference_out), = hf_generate(smolvlm_dir, [image_prompt(text["text"], [_image_of(png_bytes(1))])],
                                                  6)
    assert chats["a"].usage.prompt_tokens == len(reference_ids)
    assert chats["a"].usage.completion_tokens == len(reference_out)
    error = err_lines[0]["response"]
    assert error["status_code"] == 400 and error["body"]["error"]["type"] == "invalid_request_error"
    assert error["body"]["error"]["message"] == \
        "row d: image 1 of 1 (images/missing.png, body.messages[0].content[1]): not found"


def _image_of(data: bytes):
    import io

    from PIL import Image

    from tests.vision_helpers import image_input

    return image_input(Image.open(io.BytesIO(data)).convert("RGB"))
