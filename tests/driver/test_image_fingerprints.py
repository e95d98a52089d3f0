"""Images in request fingerprints on the S3 test server: planning (an incremental run's scan, output.dedupe
prompts) computes the fingerprint the worker writes; a picture replaced under the same key is a changed
request with input.image_fingerprint content, and not with reference."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pytest
import s3fs
from PIL import Image

from jobrunner.driver.plan import plan_job
from jobrunner.driver.row_images import image_prints
from jobrunner.driver.rows import fingerprint_roles, fingerprint_salt
from jobrunner.driver.shards import plan_shards
from jobrunner.driver.worker import ShardRunner
from jobrunner.io.done_ids import DoneIdsBuilder
from jobrunner.io.done_rows import RequestColumns, scan_file
from jobrunner.io.parts import read_part
from jobrunner.io.prompt_dupes import find_prompt_duplicates
from jobrunner.io.storage import Storage
from jobrunner.spec import spec_from_dict
from tests.driver.fake_engine import FakeEngine
from tests.driver.helpers import new_bucket


def png(color) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), color).save(buf, format="PNG")
    return buf.getvalue()


def _lines(urls: list[str]) -> str:
    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]}]}
        for i, url in enumerate(urls)]
    return "".join(json.dumps(r) + "\n" for r in rows)


def _spec(bucket, opts, mode="content"):
    return spec_from_dict({"name": "f", "input": {"url": f"s3://{bucket}/in/prompts.jsonl", "storage_options": opts,
                                                  "messages_column": "messages", "id_column": "id",
                                                  "image_fingerprint": mode},
                           "output": {"url": f"s3://{bucket}/out-{mode}", "storage_options": opts,
                                      "mode": "incremental"}})


def _worker_fingerprints(spec) -> dict[str, int]:
    runner = ShardRunner(FakeEngine(max_num_seqs=2, takes_images=True), spec, "w0", 0.0, {"device": "cpu"})
    plan = plan_job(spec)
    try:
        result = runner.run_shard(plan_shards(plan.files, spec.rows_per_shard)[0])
    finally:
        runner.stop()
    rows = read_part(Storage(spec.output.url, spec.output.storage_options), result.part).to_pylist()
    assert all(r["error"] is None and r["num_images"] == 1 for r in rows), rows
    return {r["id"]: r["request_fingerprint"] for r in rows}


def _scan(spec, written: dict[str, int]):
    builder = DoneIdsBuilder()
    builder.add(pa.array(list(written)), np.array(list(written.values()), np.int64).view(np.uint64), 0)
    request = RequestColumns(fingerprint_roles(spec), fingerprint_salt(spec), image_prints(spec))
    return scan_file(plan_job(spec).files[0], spec.input.storage_options, "auto", "id", builder.finish(), request)


@pytest.mark.parametrize("mode", ["content", "reference"])
def test_planning_matches_the_worker_and_sees_a_replaced_picture(s3_server, mode):
    opts = s3_server["storage_options"]
    bucket = new_bucket(s3_server)
    fs = s3fs.S3FileSystem(**opts)
    fs.pipe(f"{bucket}/in/images/a.png", png((255, 0, 0)))
    fs.pipe(f"{bucket}/in/images/b.png", png((0, 0, 255)))
    inline = "data:image/png;base64," + __import__("base64").b64encode(png((0, 255, 0))).decode()
    fs.pipe(f"{bucket}/in/prompts.jsonl", _lines(["images/a.png", f"s3://{bucket}/in/images/b.png", inline,
                                                   "images/a.png"]).encode())
    spec = _spec(bucket, opts, mode)
    written = _worker_fingerprints(spec)
    assert written["q0"] == written["q3"] != written["q1"]  # the same image by the same name: the same request
    scan = _scan(spec, written)
    assert (scan.num_skipped, scan.num_changed) == (4, 0)
    dupes = find_prompt_duplicates(plan_job(spec).files, opts, "auto", "id", fingerprint_roles(spec),
                                   fingerprint_salt(spec), image_prints(spec))
    assert dupes.table.column("dedupe_of").to_pylist() == ["q0"]  # q3 repeats q0
    fs.pipe(f"{bucket}/in/images/a.png", png((255, 255, 0)))  # same key, another picture
    scan = _scan(spec, written)
    expected = [(0, "q0"), (3, "q3")] if mode == "content" else []
    assert scan.changed == expected and scan.num_skipped == 4


def test_the_resume_check_names_a_changed_image_column_or_fingerprint_rule():
    from jobrunner.driver.resume_check import spec_differences

    def spec(**inp):
        return spec_from_dict({"name": "x", "input": {"url": "u.parquet", "prompt_column": "p", **inp},
                               "output": {"url": "o"}}).redacted()

    now = spec()
    before_images = {**now, "input": {k: v for k, v in now["input"].items()
                                      if not k.startswith(("image_", "max_images"))}}  # written by an older version
    assert spec_differences(before_images, now) == []
    assert spec_differences(now, spec(image_column="img", image_fingerprint="reference")) == [
        ("input.image_column", None, "img"), ("input.image_fingerprint", "content", "reference")]
    assert spec_differences(now, spec(image_max_pixels=10)) == []  # the limits may change between runs
