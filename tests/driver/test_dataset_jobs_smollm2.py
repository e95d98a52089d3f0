"""The committed OpenAI batch example (jobs/openai_batch.yaml) end to end on the embedded SmolLM2."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from jobrunner.driver.job import run_job
from jobrunner.spec import load_spec
from tests.driver.helpers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.heavy, pytest.mark.timeout(600)]


def test_openai_batch_example_on_smollm2(local_ray, tmp_path):
    spec = load_spec(REPO / "jobs" / "openai_batch.yaml", [
        f"input.url={REPO / 'examples' / 'data' / 'openai_batch.jsonl'}", f"output.url={tmp_path / 'out'}",
        "cluster.num_cpus_per_worker=1"])
    result = run_job(spec, show_progress=False)
    assert result.ok, result.summary()
    requests = {r["custom_id"]: r for r in map(json.loads, (REPO / "examples/data/openai_batch.jsonl").open())}
    lines = (tmp_path / "out" / "_openai" / "output.jsonl").read_text().splitlines()
    outputs = {o["custom_id"]: o["response"]["body"] for o in map(json.loads, lines)}
    assert list(outputs) == list(requests)  # every request answered, in input order
    assert (tmp_path / "out" / "_openai" / "errors.jsonl").read_text() == ""
    chats = {k: ChatCompletion.model_validate(v) for k, v in outputs.items() if k != "mt_bench-0002"}
    assert len(chats["gsm8k-0001"].choices) == 3
    assert all(len(t.top_logprobs) == 3 for t in chats["gsm8k-0002"].choices[0].logprobs.content)
    schema = requests["gsm8k-0003"]["body"]["response_format"]["json_schema"]["schema"]
    jsonschema.validate(json.loads(chats["gsm8k-0003"].choices[0].message.content), schema)
    assert all(c.message.content for chat in chats.values() for c in chat.choices)
    text = Completion.model_validate(outputs["mt_bench-0002"])
    assert text.choices[0].text and len(text.choices[0].logprobs.tokens) == text.usage.completion_tokens
