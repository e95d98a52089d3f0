"""Images through engine.backend openai (issue 49): a prompt's image parts go to the endpoint as OpenAI
``image_url`` parts holding ``data:`` URLs of the image's own bytes; the token estimate counts each image."""

from __future__ import annotations

import base64
import time

import pytest

from jobrunner.endpoint_backend.engine import EndpointConfig, EndpointEngine
from jobrunner.endpoint_backend.transport import Transport
from jobrunner.endpoint_backend.wire import image_tokens_estimate, request_body, without_images
from jobrunner.engine.sampling_params import SamplingParams
from tests.endpoint.tiny_server import MODEL, TinyServer
from tests.vision_helpers import image_input, image_prompt, make_test_image

pytestmark = pytest.mark.timeout(120)
KEY = "sk-tiny-images-000111"


def _image(seed: int, width: int = 40, height: int = 24):
    return image_input(make_test_image(width, height, seed), source=f"test-{seed}.png")


def test_image_parts_become_data_url_image_url_parts():
    first, second = _image(1), _image(2)
    prompt = [{"role": "system", "content": "Be brief."}, *image_prompt("Compare them.", [first, second])]
    path, body = request_body("m", prompt, SamplingParams(max_tokens=5))
    assert path == "/chat/completions"
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    parts = body["messages"][1]["content"]
    assert [p["type"] for p in parts] == ["image_url", "image_url", "text"] and parts[2]["text"] == "Compare them."
    for part, image in zip(parts, (first, second), strict=False):
        head, data = part["image_url"]["url"].split(",", 1)
        assert head == "data:image/png;base64" and base64.b64decode(data) == image.data
    assert prompt[1]["content"][0]["image"] is first  # the row's own prompt is left as it was
    assert without_images(prompt)[1]["content"] == [{"type": "text", "text": "Compare them."}]


def test_each_image_is_estimated_per_512_pixel_tile():
    assert image_tokens_estimate((40, 24)) == 85 + 170
    assert image_tokens_estimate((1024, 513)) == 85 + 170 * 4
    config = EndpointConfig(base_url="http://127.0.0.1:9/v1", model=MODEL)
    engine = EndpointEngine(config, Transport(config.base_url, KEY, config.timeout_s))
    try:
        text_only = engine._estimate_prompt([{"role": "user", "content": [{"type": "text", "text": "abcdefgh"}]}],
                                            None)
        with_two = engine._estimate_prompt(image_prompt("abcdefgh", [_image(1), _image(2, 600, 20)]), None)
    finally:
        engine.close()
    assert with_two == text_only + (85 + 170) + (85 + 170 * 2)


def test_rows_with_images_reach_the_server_and_are_answered():
    images = [_image(i) for i in range(3)]
    with TinyServer(KEY) as server:
        config = EndpointConfig(base_url=server.url, model=MODEL, max_concurrency=2, backoff_base_s=0.01)
        engine = EndpointEngine(config, Transport(server.url, KEY, config.timeout_s))
        for i, image in enumerate(images):
            engine.add_request(f"r{i}", image_prompt(f"Describe picture {i}.", [image]), SamplingParams(max_tokens=4))
        outputs, deadline = {}, time.monotonic() + 60
        try:
            while engine.has_unfinished_requests():
                assert time.monotonic() < deadline, "the engine did not finish"
                outputs.update({o.request_id: o for o in engine.step()})
        finally:
            engine.close()
        bodies = list(server.bodies)
    assert sorted(outputs) == ["r0", "r1", "r2"] and {o.text for o in outputs.values()} == {"ok"}
    assert all(o.error is None for o in outputs.values())
    sent = {b["messages"][0]["content"][1]["text"]: b["messages"][0]["content"][0] for b in bodies}
    for i, image in enumerate(images):
        assert sent[f"Describe picture {i}."] == {"type": "image_url", "image_url": {"url": image.data_url()}}
