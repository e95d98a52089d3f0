"""The image job of issue 49's target, shared by our engine's run and vLLM's: 32 rows on the S3 test server whose
image column mixes data URLs, local files and s3:// keys (a few rows hold two images), plus one corrupt and one
missing image. Images are made here with PIL (tests/vision_helpers.make_test_image)."""

from __future__ import annotations

import base64
import io
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from jobrunner.io.parts import read_output
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import new_bucket
from tests.vision_helpers import make_test_image

NUM_ROWS = 32
CORRUPT_ROW, MISSING_ROW = "row-30", "row-31"
QUESTIONS = ["Describe the picture in one sentence.", "What colour is the square in the image?",
             "Read the text in this document and list the totals."]
SECOND_IMAGE = {4: 15, 14: 25, 24: 5}  # row -> the seed of its second image (data URL + local, ...)
SIZES = [(40, 24), (32, 32), (64, 64), (20, 70), (100, 30), (16, 16), (48, 40), (30, 50)]


def png_bytes(seed: int) -> bytes:
    width, height = SIZES[seed % len(SIZES)]
    buffer = io.BytesIO()
    make_test_image(width, height, seed).save(buffer, format="PNG")
    return buffer.getvalue()


def write_image_job(fs, bucket: str, local_dir: Path) -> str:
    """Write the images (s3://bucket/images/, ``local_dir``) and the input Parquet (s3://bucket/in/rows.parquet,
    row groups of 8); returns the input URL. Rows 0-9 data URLs, 10-19 local paths, 20-29 s3:// keys; rows 4,
    14 and 24 hold a second image (of another kind); row 30 a corrupt local PNG, row 31 a missing s3:// key."""
    local_dir.mkdir(parents=True, exist_ok=True)
    images: list[list[str]] = []
    for i in range(30):
        data = png_bytes(i)
        if i < 10:
            images.append(["data:image/png;base64," + base64.b64encode(data).decode()])
        elif i < 20:
            (local_dir / f"local-{i}.png").write_bytes(data)
            images.append([str(local_dir / f"local-{i}.png")])
        else:
            fs.pipe_file(f"{bucket}/images/s3-{i}.png", data)
            images.append([f"s3://{bucket}/images/s3-{i}.png"])
    for row, seed in SECOND_IMAGE.items():
        images[row].append(images[seed][0])
    (local_dir / "corrupt.png").write_bytes(png_bytes(30)[:40])  # a PNG cut after its header
    images.append([str(local_dir / "corrupt.png")])
    images.append([f"s3://{bucket}/images/missing.png"])
    table = pa.table({"id": [f"row-{i:02d}" for i in range(NUM_ROWS)],
                      "prompt": [QUESTIONS[i % len(QUESTIONS)] for i in range(NUM_ROWS)],
                      "image": pa.array(images, pa.list_(pa.string()))})
    with fs.open(f"{bucket}/in/rows.parquet", "wb") as f:
        pq.write_table(table, f, row_group_size=8)
    return f"s3://{bucket}/in/rows.parquet"


def image_job_spec(model_dir: str | Path, input_url: str, storage_options: dict, output_url: str,
                   sampling: dict | None = None, **engine) -> dict:
    """The job: the tiny SmolVLM, float32, greedy 8 tokens, one worker, shards of 8 rows."""
    return {"name": "caption-test", "model": {"source": str(model_dir), "dtype": "float32"},
            "input": {"url": input_url, "prompt_column": "prompt", "image_column": "image", "id_column": "id",
                      "rows_per_shard": 8, "storage_options": storage_options},
            "sampling": {"max_tokens": 8, "temperature": 0.0, **(sampling or {})},
            "engine": {"max_num_seqs": 8, "max_model_len": 1024, **engine},
            "cluster": {"num_workers": 1, "num_cpus_per_worker": 1, "retry_backoff_s": 0.1},
            "output": {"url": output_url, "mode": "resume"}}


def row_prompt(index: int) -> list[dict]:
    """Row ``index``'s prompt as the engine gets it (tests/vision_helpers.image_prompt), its images decoded
    from the same PNG bytes the job reads: what transformers' own generate is given for the same row."""
    from PIL import Image

    from tests.vision_helpers import image_input, image_prompt

    seeds = [index] + ([SECOND_IMAGE[index]] if index in SECOND_IMAGE else [])
    images = [image_input(Image.open(io.BytesIO(png_bytes(seed))).convert("RGB")) for seed in seeds]
    return image_prompt(QUESTIONS[index % len(QUESTIONS)], images)


def image_job(s3_server, tmp_path, model_dir, sampling: dict | None = None, **engine):
    """(spec, fs, bucket) of the image job, its input written."""
    import s3fs

    opts = s3_server["storage_options"]
    bucket = new_bucket(s3_server)
    fs = s3fs.S3FileSystem(**opts)
    input_url = write_image_job(fs, bucket, tmp_path / "local-images")
    spec = spec_from_dict(image_job_spec(model_dir, input_url, opts, str(tmp_path / "out"), sampling, **engine))
    return spec, fs, bucket


def check_rows(out_url: str) -> dict[str, dict]:
    """The output's rows by id, after checking issue 49's target: 32 ids once, 30 answers, 2 errors naming
    their image."""
    rows = read_output(out_url).to_pylist()
    counts = Counter(r["id"] for r in rows)
    assert len(counts) == NUM_ROWS and set(counts.values()) == {1}, counts
    by_id = {r["id"]: r for r in rows}
    errors = {i for i, r in by_id.items() if r["error"] is not None}
    assert errors == {CORRUPT_ROW, MISSING_ROW}, {i: by_id[i]["error"] for i in errors}
    assert by_id[CORRUPT_ROW]["error"].startswith(f"row {CORRUPT_ROW}: image 1 of 1 (")
    assert by_id[CORRUPT_ROW]["error"].endswith("image_column 'image'[0]): not a readable image (not a format "
                                                "Pillow knows, or not an image)")
    assert by_id[MISSING_ROW]["error"].endswith("/images/missing.png, image_column 'image'[0]): not found")
    answered = [r for i, r in by_id.items() if i not in errors]
    assert all(r["finish_reason"] in ("stop", "length") and r["num_output_tokens"] > 0 for r in answered)
    assert [by_id[f"row-{i:02d}"]["num_images"] for i in (0, 4, 14, 24, 29)] == [1, 2, 2, 2, 1]
    assert all(r["num_image_tokens"] >= 16 * r["num_images"] for r in answered)
    assert all(r["num_prompt_tokens"] > r["num_image_tokens"] for r in answered)
    return by_id
