"""Rows with images through the worker (no Ray): an image column (paths, data URLs, lists, bytes) and
image_url parts in messages, fetched in the worker; a bad image is its row's error naming the row and the
image; a text-only engine refuses image rows one by one; the rows' metrics count images and image tokens."""

from __future__ import annotations

import base64
import hashlib
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from jobrunner.driver.plan import plan_job
from jobrunner.driver.rows import row_fingerprints
from jobrunner.driver.shards import plan_shards
from jobrunner.driver.worker import ShardRunner
from jobrunner.io.parts import read_part
from jobrunner.io.reader import ROW_INDEX, list_input_files
from jobrunner.io.storage import Storage
from jobrunner.spec import spec_from_dict
from tests.driver.fake_engine import IMAGE_TOKENS, FakeEngine


def png(color, size=(8, 6)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _images(tmp_path):
    (tmp_path / "images").mkdir(exist_ok=True)
    (tmp_path / "images" / "a.png").write_bytes(png((0, 200, 0)))
    (tmp_path / "images" / "bad.png").write_bytes(png((1, 1, 1))[:30])


def _run(tmp_path, table: pa.Table, takes_images: bool = True, **inp):
    pq.write_table(table, tmp_path / "in.parquet")
    spec = spec_from_dict({"name": "t", "input": {"url": str(tmp_path / "in.parquet"), "id_column": "id", **inp},
                           "sampling": {"max_tokens": 2}, "output": {"url": str(tmp_path / "out")}})
    engine = FakeEngine(max_num_seqs=2, max_model_len=200, takes_images=takes_images)
    runner = ShardRunner(engine, spec, "w0", 0.0, {"device": "cpu"})
    shard = plan_shards(list_input_files(spec.input.url, {}), spec.rows_per_shard)[0]
    try:
        result = runner.run_shard(shard)
    finally:
        runner.stop()
    storage = Storage(spec.output.url)
    rows = {r["id"]: r for r in read_part(storage, result.part).to_pylist()}
    return spec, result, rows


def test_image_column_of_paths_data_urls_and_lists(tmp_path):
    _images(tmp_path)
    green = data_url(png((0, 200, 0)))
    table = pa.table({"id": ["r0", "r1", "r2", "r3", "r4", "r5"],
                      "prompt": ["Describe it."] * 6,
                      "img": [[green], ["images/a.png"], ["images/a.png", green], ["images/bad.png"],
                              ["images/a.png", "images/missing.png"], None]})
    spec, result, rows = _run(tmp_path, table, prompt_column="prompt", image_column="img")
    assert result.rows == 6 and result.num_errors == 2  # the shard committed its good rows
    assert rows["r3"]["error"].startswith("row r3: image 1 of 1 (images/bad.png, image_column 'img'[0]): "
                                          "not a readable image")
    assert rows["r4"]["error"] == "row r4: image 2 of 2 (images/missing.png, image_column 'img'[1]): not found"
    # summaries count image errors by why, whatever the row and image
    assert result.error_kinds == {"image: not a readable image (not a format Pillow knows, or not an image)": 1,
                                  "image: not found": 1}
    assert [rows[r]["num_images"] for r in sorted(rows)] == [1, 1, 2, 1, 2, 0]
    assert [rows[r]["num_image_tokens"] for r in ("r0", "r1", "r2", "r5")] == [IMAGE_TOKENS, IMAGE_TOKENS,
                                                                              2 * IMAGE_TOKENS, 0]
    # "Describe it." is 2 words; each image: its img:<digest> word plus IMAGE_TOKENS - 1 more
    assert [rows[r]["num_prompt_tokens"] for r in ("r0", "r2", "r5")] == [2 + IMAGE_TOKENS, 2 + 2 * IMAGE_TOKENS, 2]
    assert all(rows[r]["generated_text"] == "tok0 tok1" for r in ("r0", "r1", "r2", "r5"))


def test_image_column_of_bytes_and_the_fingerprint_follows_the_bytes(tmp_path):
    table = pa.table({"id": ["a", "b"], "prompt": ["Caption.", "Caption."],
                      "img": pa.array([png((10, 20, 30)), png((10, 20, 31))], pa.binary())})
    spec, result, rows = _run(tmp_path, table, prompt_column="prompt", image_column="img")
    assert result.num_errors == 0 and rows["a"]["num_images"] == 1
    # same text, different image: different request fingerprints (the bytes are hashed as the column's value)
    assert rows["a"]["request_fingerprint"] != rows["b"]["request_fingerprint"]
    same = table.append_column(ROW_INDEX, pa.array([0, 1], pa.int64()))
    same = same.set_column(2, "img", pa.array([png((10, 20, 30))] * 2, pa.binary()))
    prints = row_fingerprints(spec, same)
    assert prints[0] == prints[1] == rows["a"]["request_fingerprint"]


def test_messages_with_image_url_parts(tmp_path):
    _images(tmp_path)
    chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "images/a.png"}},
                                         {"type": "text", "text": "What colour?"}]}]
    bad = [{"role": "user", "content": [{"type": "text", "text": "And this?"},
                                        {"type": "image_url", "image_url": "images/bad.png"}]}]
    table = pa.table({"id": ["ok", "bad", "text"], "messages": [json.dumps(chat), json.dumps(bad),
                                                                 json.dumps([{"role": "user", "content": "Hi"}])]})
    spec, result, rows = _run(tmp_path, table, messages_column="messages")
    assert rows["ok"]["error"] is None and rows["ok"]["num_images"] == 1
    assert rows["ok"]["num_prompt_tokens"] == 2 + IMAGE_TOKENS
    assert rows["bad"]["error"].startswith("row bad: image 1 of 1 (images/bad.png, messages[0].content[1]): ")
    assert rows["text"]["num_images"] == 0 and rows["text"]["error"] is None


def test_a_text_only_engine_refuses_image_rows_one_by_one(tmp_path):
    _images(tmp_path)
    table = pa.table({"id": ["img", "txt"], "prompt": ["Describe.", "Say hi."], "img": [["images/a.png"], None]})
    spec, result, rows = _run(tmp_path, table, takes_images=False, prompt_column="prompt", image_column="img")
    assert rows["img"]["error"] == "engine rejected the request: model FakeForTests does not take images"
    assert rows["txt"]["error"] is None and rows["txt"]["generated_text"] == "tok0 tok1"


def test_too_many_images_is_the_rows_error(tmp_path):
    _images(tmp_path)
    table = pa.table({"id": ["many"], "prompt": ["x"], "img": [["images/a.png"] * 3]})
    spec, result, rows = _run(tmp_path, table, prompt_column="prompt", image_column="img", max_images_per_row=2)
    assert rows["many"]["error"] == "3 images, over input.max_images_per_row=2"
    assert rows["many"]["num_images"] == 0


def test_the_fingerprint_holds_a_referenced_images_content(tmp_path):
    _images(tmp_path)
    table = pa.table({"id": ["r"], "prompt": ["Describe."], "img": [["images/a.png"]]})
    spec, _, first = _run(tmp_path, table, prompt_column="prompt", image_column="img")
    (tmp_path / "images" / "a.png").write_bytes(png((255, 0, 0)))  # same name, other picture
    spec, _, second = _run(tmp_path, table, prompt_column="prompt", image_column="img")
    assert first["r"]["request_fingerprint"] != second["r"]["request_fingerprint"]
    spec, _, third = _run(tmp_path, table, prompt_column="prompt", image_column="img")
    assert third["r"]["request_fingerprint"] == second["r"]["request_fingerprint"]
    # input.image_fingerprint: reference hashes the name only
    spec, _, by_name = _run(tmp_path, table, prompt_column="prompt", image_column="img",
                            image_fingerprint="reference")
    (tmp_path / "images" / "a.png").write_bytes(png((0, 0, 255)))
    spec, _, by_name_again = _run(tmp_path, table, prompt_column="prompt", image_column="img",
                                  image_fingerprint="reference")
    assert by_name["r"]["request_fingerprint"] == by_name_again["r"]["request_fingerprint"]
    assert hashlib.sha256(png((0, 0, 255))).hexdigest()  # the picture the engine saw last


def test_openai_batch_lines_with_image_parts(tmp_path):
    _images(tmp_path)
    green = data_url(png((0, 200, 0)))

    def line(cid, *urls):
        parts = [{"type": "text", "text": "Describe."}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
        body = {"model": "m", "messages": [{"role": "user", "content": parts}], "max_tokens": 2}
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n"

    (tmp_path / "batch.jsonl").write_text(line("a", green) + line("b", "images/a.png", green) +
                                          line("c", "images/nope.png"))
    spec = spec_from_dict({"name": "t", "model": {"source": "m"},
                           "input": {"url": str(tmp_path / "batch.jsonl"), "format": "openai_batch"},
                           "output": {"url": str(tmp_path / "out")}})
    runner = ShardRunner(FakeEngine(max_num_seqs=2, takes_images=True), spec, "w0", 0.0, {"device": "cpu"})
    try:
        result = runner.run_shard(plan_shards(plan_job(spec).files, 1000)[0])
    finally:
        runner.stop()
    rows = {r["id"]: r for r in read_part(Storage(spec.output.url), result.part).to_pylist()}
    assert [rows[c]["num_images"] for c in "abc"] == [1, 2, 1]
    assert [rows[c]["num_image_tokens"] for c in "ab"] == [IMAGE_TOKENS, 2 * IMAGE_TOKENS]
    assert rows["a"]["error"] is None and rows["b"]["generated_text"] == "tok0 tok1"
    assert rows["c"]["error"] == "row c: image 1 of 1 (images/nope.png, body.messages[0].content[1]): not found"


def test_messages_output_names_each_image_as_text(tmp_path):
    _images(tmp_path)
    table = pa.table({"id": ["r"], "prompt": ["What colour?"], "img": [["images/a.png"]]})
    pq.write_table(table, tmp_path / "in.parquet")
    spec = spec_from_dict({"name": "t", "input": {"url": str(tmp_path / "in.parquet"), "id_column": "id",
                                                  "prompt_column": "prompt", "image_column": "img",
                                                  "system_prompt": "Be brief."},
                           "sampling": {"max_tokens": 2},
                           "output": {"url": str(tmp_path / "out"), "format": "messages"}})
    runner = ShardRunner(FakeEngine(max_num_seqs=2, takes_images=True), spec, "w0", 0.0, {"device": "cpu"})
    try:
        result = runner.run_shard(plan_shards(plan_job(spec).files, 1000)[0])
    finally:
        runner.stop()
    (row,) = read_part(Storage(spec.output.url), result.part).to_pylist()
    assert row["messages"] == [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "[image: images/a.png]\nWhat colour?"},
                               {"role": "assistant", "content": "tok0 tok1"}]


def test_our_text_only_engine_refuses_image_rows_and_runs_the_rest(tmp_path, tiny_llama_hf_dir):
    from jobrunner.driver.engine_factory import build_engine

    _images(tmp_path)
    table = pa.table({"id": ["img", "txt"], "prompt": ["Describe.", "The quick brown fox"],
                      "img": [["images/a.png"], None]})
    pq.write_table(table, tmp_path / "in.parquet")
    spec = spec_from_dict({"name": "t", "model": {"source": str(tiny_llama_hf_dir), "dtype": "float32"},
                           "input": {"url": str(tmp_path / "in.parquet"), "id_column": "id",
                                     "prompt_column": "prompt", "image_column": "img"},
                           "sampling": {"max_tokens": 3}, "engine": {"max_num_seqs": 2, "max_model_len": 128},
                           "output": {"url": str(tmp_path / "out")}})
    engine = build_engine(spec)
    runner = ShardRunner(engine, spec, "w0", 0.0, {"device": "cpu"})
    try:
        result = runner.run_shard(plan_shards(plan_job(spec).files, 1000)[0])
    finally:
        runner.stop()
    rows = {r["id"]: r for r in read_part(Storage(spec.output.url), result.part).to_pylist()}
    assert result.rows == 2 and result.num_errors == 1
    assert rows["img"]["finish_reason"] == "error"
    assert "is a text-only model and takes no images" in rows["img"]["error"]
    assert rows["img"]["num_images"] == 1
    assert rows["txt"]["error"] is None and rows["txt"]["num_output_tokens"] == 3
    assert rows["txt"]["num_images"] == 0 and rows["txt"]["num_image_tokens"] == 0
