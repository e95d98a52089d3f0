"""Images of a row (io/images.py, io/image_parts.py): every URL kind fetched for real (data:, local paths,
memory://, the moto S3 server, a local http server), decoded to RGB under the limits; every failure names the
row and the image."""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import threading

import fsspec
import pytest
from PIL import Image

from jobrunner.io.image_parts import check_count, column_refs, parse_content, parts_text, with_images
from jobrunner.io.images import (
    ImageContext,
    ImageError,
    ImageFetcher,
    ImageLimits,
    ImageRef,
    base_of,
    image_error_kind,
    load_image,
    resolve_prompt,
)
from tests.driver.helpers import new_bucket


def png(color=(200, 10, 10), size=(8, 6), mode="RGB", fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


CTX = ImageContext({})


def test_data_url_decodes_to_rgb_with_the_bytes_digest():
    data = png(mode="RGBA", color=(1, 2, 3, 4))
    image = load_image(ImageRef(data_url(data), "messages[0].content[0]"), CTX)
    assert image.digest == hashlib.sha256(data).hexdigest()
    assert image.mime == "image/png" and image.size == (8, 6) and image.pixels.mode == "RGB"
    assert image.pixels.getpixel((0, 0)) == (1, 2, 3)
    assert image.data == data and image.source.startswith("data:image/png;base64,")


def test_jpeg_bytes_and_a_percent_encoded_data_url():
    jpeg = png(fmt="JPEG")
    assert load_image(ImageRef(jpeg, "image_column 'img'"), CTX).mime == "image/jpeg"
    raw = png()
    from urllib.parse import quote_from_bytes
    image = load_image(ImageRef("data:image/png," + quote_from_bytes(raw), "x"), CTX)
    assert image.digest == hashlib.sha256(raw).hexdigest()


def test_local_paths_absolute_and_relative_to_the_input_file(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(png(color=(0, 255, 0)))
    ctx = ImageContext({}, base_of(str(tmp_path / "prompts.parquet")))
    assert load_image(ImageRef("images/a.png", "x"), ctx).pixels.getpixel((1, 1)) == (0, 255, 0)
    assert load_image(ImageRef(str(tmp_path / "images" / "a.png"), "x"), CTX).size == (8, 6)
    assert load_image(ImageRef(f"file://{tmp_path}/images/a.png", "x"), CTX).size == (8, 6)


def test_memory_and_s3_storage_urls(s3_server):
    with fsspec.open("memory://imgs/m.png", "wb") as f:
        f.write(png(color=(9, 9, 9)))
    assert load_image(ImageRef("memory://imgs/m.png", "x"), CTX).pixels.getpixel((0, 0)) == (9, 9, 9)
    bucket = new_bucket(s3_server)
    opts = s3_server["storage_options"]
    with fsspec.open(f"s3://{bucket}/data/images/cat.png", "wb", **opts) as f:
        f.write(png(color=(1, 100, 200)))
    ctx = ImageContext(opts, base_of(f"s3://{bucket}/data/prompts.jsonl"))
    assert load_image(ImageRef(f"s3://{bucket}/data/images/cat.png", "x"), ctx).pixels.getpixel((0, 0)) == (1, 100, 200)
    assert load_image(ImageRef("images/cat.png", "x"), ctx).size == (8, 6)  # relative key beside the input
    with pytest.raises(ImageError, match="not found"):
        load_image(ImageRef(f"s3://{bucket}/data/images/dog.png", "x"), ctx)


@pytest.fixture
def http_dir(tmp_path):
    """A real http server over tmp_path on a port the OS picks."""
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path), **k)  # noqa: E731
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield tmp_path, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_images_and_a_404(http_dir):
    folder, base = http_dir
    (folder / "h.png").write_bytes(png(color=(5, 6, 7)))
    assert load_image(ImageRef(f"{base}/h.png", "x"), CTX).pixels.getpixel((0, 0)) == (5, 6, 7)
    with pytest.raises(ImageError, match="HTTP 404"):
        load_image(ImageRef(f"{base}/nope.png", "x"), CTX)


def test_bad_images_are_named_errors(tmp_path):
    (tmp_path / "corrupt.png").write_bytes(png()[:40])  # a PNG header, its data cut off
    (tmp_path / "text.png").write_bytes(b"hello, not an image")
    (tmp_path / "big.png").write_bytes(png(size=(64, 64)))
    small = ImageContext({}, str(tmp_path), ImageLimits(max_bytes=100, max_pixels=10_000))
    cases = [("corrupt.png", CTX, "not a readable image"), ("text.png", CTX, "not a readable image"),
             ("missing.png", CTX, "not found"), ("/", CTX, "folder|cannot read|not found"),
             (data_url(png(size=(64, 64))), small, "too large: over input.image_max_bytes=100"),
             ("big.png", small, "too large: over input.image_max_bytes=100"),
             (data_url(png(size=(200, 60), fmt="GIF")), ImageContext({}, limits=ImageLimits(max_pixels=10_000)),
              "200x60 pixels, over input.image_max_pixels=10000"),
             ("data:image/png;base64", CTX, "without a comma"), ("data:image/png;base64,", CTX, "empty")]
    for value, ctx, why in cases:
        ctx = ImageContext({}, str(tmp_path), ctx.limits)
        with pytest.raises(ImageError, match=why):
            load_image(ImageRef(value, "x"), ctx)


def test_a_failing_image_names_the_row_and_which_image(tmp_path):
    prompt = [{"role": "user", "content": [
        {"type": "image", "image": ImageRef(data_url(png()), "messages[0].content[0]")},
        {"type": "image", "image": ImageRef("gone.png", "messages[0].content[1]")},
        {"type": "text", "text": "both?"}]}]
    with pytest.raises(ImageError) as err:
        resolve_prompt(prompt, "row-7", ImageContext({}, str(tmp_path)))
    assert str(err.value) == "row row-7: image 2 of 2 (gone.png, messages[0].content[1]): not found"
    ok = resolve_prompt(prompt[:1] and [{"role": "user", "content": prompt[0]["content"][::2]}], "r", CTX)
    assert [p["type"] for p in ok[0]["content"]] == ["image", "text"]
    assert ok[0]["content"][0]["image"].digest == hashlib.sha256(png()).hexdigest()
    assert isinstance(prompt[0]["content"][0]["image"], ImageRef)  # the row's prompt is left as it was


def test_fetcher_prefetches_and_hands_each_prompt_once(tmp_path):
    (tmp_path / "a.png").write_bytes(png())
    fetcher = ImageFetcher(threads=2)
    ctx = ImageContext({}, str(tmp_path))
    prompt = [{"role": "user", "content": [{"type": "image", "image": ImageRef("a.png", "x")}]}]
    assert fetcher.is_ready("k", "a text prompt")
    fetcher.prefetch("k", prompt, "r1", ctx)
    resolved = fetcher.take("k", prompt, "r1", ctx)
    assert resolved[0]["content"][0]["image"].size == (8, 6)
    assert not fetcher._pending  # forgotten once taken: its pixels go with the engine's request
    fetcher.close()


def test_content_parts_in_openai_forms():
    parts = parse_content([{"type": "text", "text": "What is it?"},
                           {"type": "image_url", "image_url": {"url": "s3://b/x.png", "detail": "low"}},
                           {"type": "image_url", "image_url": "data:image/png;base64,AAAA"},
                           {"type": "input_image", "image_url": "y.png"}], "body.messages[0].content")
    assert [p["type"] for p in parts] == ["text", "image", "image", "image"]
    assert [p["image"].value for p in parts[1:]] == ["s3://b/x.png", "data:image/png;base64,AAAA", "y.png"]
    assert parts[3]["image"].where == "body.messages[0].content[3]"
    text_only = [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "image_url": None}]
    assert parse_content(text_only, "m") == "a\nb"
    assert parts_text(parts) == ("What is it?\n[image: s3://b/x.png]\n[image: data:image/png;base64,AAAA]\n"
                                 "[image: y.png]")
    for bad, why in [([{"type": "image_url"}], "needs image_url.url"), ([{"type": "audio"}], "'audio' is not "
                     "supported"), ([], "non-empty list"), ([{"type": "text", "text": 3}], "string 'text'")]:
        with pytest.raises(ValueError, match=why):
            parse_content(bad, "m")


def test_image_column_values_and_their_place_in_the_prompt():
    assert column_refs(None, "img") == [] and column_refs([], "img") == []
    refs = column_refs([b"\x89PNG", "a.png", {"bytes": None, "path": "s3://b/c.png"}], "img")
    assert [r.value for r in refs] == [b"\x89PNG", "a.png", "s3://b/c.png"]
    assert [r.where for r in refs] == ["image_column 'img'[0]", "image_column 'img'[1]", "image_column 'img'[2]"]
    assert refs[0].source == "<4 bytes>" and repr(refs[0]) == "ImageRef('<4 bytes>')"
    assert [r.value for r in column_refs('["a.png", "s3://b/c.png"]', "img")] == ["a.png", "s3://b/c.png"]
    with pytest.raises(ValueError, match="not a JSON array"):
        column_refs("[a.png", "img")
    with pytest.raises(ValueError, match=r"image_column 'img'\[1\]: int is not an image"):
        column_refs(["a.png", 3], "img")
    one = column_refs("x.png", "img")
    assert with_images("Describe.", one) == [{"role": "user", "content": [
        {"type": "image", "image": one[0]}, {"type": "text", "text": "Describe."}]}]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Describe."}]
    assert with_images(chat, one)[1]["content"][0] == {"type": "image", "image": one[0]}
    assert with_images(chat, one)[0] == chat[0] and chat[1]["content"] == "Describe."
    assert check_count(with_images("t", refs), 3) == 3
    with pytest.raises(ValueError, match="3 images, over input.max_images_per_row=2"):
        check_count(with_images("t", refs), 2)


def test_presigned_query_never_shown():
    ref = ImageRef("https://b.s3.amazonaws.com/x.png?X-Amz-Signature=abc&X-Amz-Credential=k", "x")
    assert ref.source == "https://b.s3.amazonaws.com/x.png"


def test_error_kinds_leave_the_row_and_the_image_out():
    from jobrunner.driver.worker import error_kind
    from jobrunner.reports.accumulators import error_kind as report_kind

    big = "row q-7a: image 1 of 3 (s3://b/x.png, messages[0].content[2]): too large: 9000x9000 pixels, over x=1"
    assert image_error_kind(big) == "image: too large: 9000x9000 pixels, over x=1"
    assert error_kind(big) == "image: too large: NxN pixels, over x=N" and report_kind(big) == "image: too large"
    assert image_error_kind("row r: prompt column 'p' is null or empty") is None


def test_image_bytes_stay_in_arrow_until_fetched():
    import pyarrow as pa

    from jobrunner.io.image_parts import arrow_cells

    data = png(color=(3, 4, 5))
    table = pa.table({"one": pa.array([data, None], pa.binary()),
                      "many": pa.array([[data, data], []], pa.list_(pa.binary())),
                      "hf": pa.array([{"bytes": data, "path": "x.png"}, {"bytes": None, "path": "y.png"}])})
    one, many, hf = (arrow_cells(table, c) for c in ("one", "many", "hf"))
    refs = column_refs(one[0], "one") + column_refs(many[0], "many") + column_refs(hf[0], "hf")
    assert [type(r.value) for r in refs] == [memoryview] * 4 and refs[0].source == f"<{len(data)} bytes>"
    assert all(load_image(r, CTX).digest == hashlib.sha256(data).hexdigest() for r in refs)
    assert column_refs(one[1], "one") == [] and column_refs(many[1], "many") == []
    assert [r.value for r in column_refs(hf[1], "hf")] == ["y.png"]
