"""What an endpoint job's console says while its workers start: the endpoint's URL (credentials cut) and model,
not 'loading model <the default alias> (dtype auto); warming up' (a local engine's lines are unchanged)."""

from __future__ import annotations

from jobrunner.driver.progress_text import describe_loading, describe_ready
from jobrunner.spec import load_spec
from tests.driver.helpers import REPO


def test_an_endpoint_worker_names_its_endpoint_and_model():
    spec = load_spec(REPO / "jobs" / "example.yaml", [
        "engine.backend=openai", "engine.endpoint.base_url=http://user:pw@llm.internal:8000/v1",
        "engine.endpoint.model=qwen-judge"])
    assert describe_loading("w0", spec) == "worker w0 placed; endpoint http://***@llm.internal:8000/v1 model qwen-judge"
    info = {"stats": {"startup_s": 1.25}, "model": {
        "backend": "openai", "endpoint": "http://user:pw@llm.internal:8000/v1", "endpoint_model": "qwen-judge"}}
    assert describe_ready("w0", info) == \
        "worker w0 ready after 1.2s; endpoint http://***@llm.internal:8000/v1 model qwen-judge"


def test_a_local_engine_still_says_loading_and_warming_up():
    spec = load_spec(REPO / "jobs" / "example.yaml", [])
    assert describe_loading("w0", spec) == f"worker w0 placed; loading model {spec.model.source}"
    info = {"stats": {"startup_s": 3.0}, "model": {"dtype": "float32"}}
    assert describe_ready("w0", info) == "worker w0 ready after 3.0s (dtype float32); warming up (first engine steps)"
