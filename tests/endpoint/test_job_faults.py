"""A job's misconfigured endpoint (a wrong key, URL or model, no server at all) stops the engine with the fix
named and no row's error; 400-style answers stay rows' errors (tests/endpoint/tiny_server.py, no model)."""

from __future__ import annotations

import time

import pytest

from jobrunner.endpoint_backend.engine import EndpointConfig, EndpointEngine
from jobrunner.endpoint_backend.faults import public_url
from jobrunner.endpoint_backend.transport import Transport
from jobrunner.engine.contract import EngineStopped
from jobrunner.engine.sampling_params import SamplingParams
from tests.endpoint.tiny_server import MODEL, TinyServer, closed_port_url

pytestmark = pytest.mark.timeout(120)
KEY = "sk-tiny-right-key-000111"


def _drive(url: str, key: str, model: str = MODEL, count: int = 4, prompt: str = "prompt",
           **settings) -> tuple[dict, str | None]:
    """Every row through an engine until it has none left or stops: (outputs by id, the stop reason)."""
    config = EndpointConfig(base_url=url, model=model, max_concurrency=2, backoff_base_s=0.01, **settings)
    engine = EndpointEngine(config, Transport(url, key, config.timeout_s))
    for i in range(count):
        engine.add_request(f"r{i}", f"{prompt} {i}", SamplingParams(max_tokens=4))
    outputs, deadline = {}, time.monotonic() + 60
    try:
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the engine neither finished nor stopped"
            for out in engine.step():
                outputs[out.request_id] = out
    except EngineStopped as exc:
        return outputs, str(exc)
    finally:
        engine.close()
    return outputs, None


def test_the_right_settings_answer_every_row():
    with TinyServer(KEY) as server:
        outputs, stopped = _drive(server.url, KEY)
    assert stopped is None and sorted(outputs) == ["r0", "r1", "r2", "r3"]
    assert {o.text for o in outputs.values()} == {"ok"} and all(o.error is None for o in outputs.values())


def test_a_wrong_key_stops_the_job_naming_the_setting_and_not_the_key():
    with TinyServer(KEY) as server:
        outputs, stopped = _drive(server.url, "sk-wrong-key-999")
        assert server.posts <= 2  # the requests in flight, then nothing more went
    assert outputs == {}  # no row got an error
    assert stopped == (f"endpoint {server.url}: HTTP 401 on POST /completions (Incorrect API key provided): "
                       "check engine.endpoint.api_key (or $OPENAI_API_KEY on the workers)")


def test_a_url_without_v1_and_a_wrong_model_say_which():
    with TinyServer(KEY) as server:
        base = server.url.removesuffix("/v1")
        _, no_v1 = _drive(base, KEY)
        _, wrong_model = _drive(server.url, KEY, model="smollm3")
    assert no_v1 == (f"endpoint {base}: HTTP 404 on POST /completions (Not Found): base_url usually ends in /v1 "
                     "(e.g. http://host:8000/v1)")
    assert wrong_model == (f"endpoint {server.url}: HTTP 404 on POST /completions (The model `smollm3` does not "
                           "exist.): engine.endpoint.model 'smollm3' is not served there; the server's models: tiny")


def test_no_server_stops_after_the_retries_and_a_400_stays_a_row_error():
    url = closed_port_url()
    outputs, stopped = _drive(url, KEY, count=2, max_retries=2)
    assert outputs == {}
    assert stopped.startswith(f"endpoint {url}: no server answered after 3 attempts (connection failed: "
                              "ConnectionRefusedError")
    assert stopped.endswith("is it running, and are engine.endpoint.base_url's host and port right?")
    with TinyServer(KEY) as server:
        outputs, stopped = _drive(server.url, KEY, count=2, prompt="too long")
    assert stopped is None
    assert {o.error for o in outputs.values()} == {"endpoint: HTTP 400: this prompt is too long"}
    assert public_url("https://user:pw@api.example.com/v1?key=abc") == "https://api.example.com/v1"
