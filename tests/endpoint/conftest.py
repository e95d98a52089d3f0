"""The endpoint tests' real server: vLLM's OpenAI-compatible server on the embedded SmolLM2 model, started
once per test session (its start-up is the slow part), behind a fault proxy of each test's own."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

# a server already running (…/v1, serving SmolLM2 float32 as "smollm2"): the tests use it instead of starting one
RUNNING_SERVER_ENV = "JOBRUNNER_TEST_ENDPOINT_URL"


@pytest.fixture(scope="session")
def vllm_endpoint():
    from jobrunner.models.sources import resolve_model_dir
    from tests.endpoint.server import start_vllm_server
    from tests.vllm_backend.vllm_python import vllm_python_or_skip

    if os.environ.get(RUNNING_SERVER_ENV):
        yield SimpleNamespace(url=os.environ[RUNNING_SERVER_ENV], model="smollm2", log_path="", model_dir="")
        return
    python = vllm_python_or_skip()
    server = start_vllm_server(python, str(resolve_model_dir("smollm2-135m-instruct")))
    try:
        yield server
    finally:
        server.stop()
