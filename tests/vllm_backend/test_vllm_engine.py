"""vLLM's engine behind the worker engine contract, for real (vLLM's CPU build in its own venv): the same token
ids as our engine for the same rows (float32, greedy), n samples, logprobs, stop strings, a JSON schema, bad
rows as error outputs, metrics from vLLM's timestamps, and a dead vLLM process replaced by a new one."""

from __future__ import annotations

import json

import pytest

from jobrunner.driver.engine_factory import build_engine, rebuild_engine
from jobrunner.engine import EngineConfig, SamplingParams, WorkerEngine
from jobrunner.engine.contract import missing_members
from jobrunner.spec import spec_from_dict
from jobrunner.vllm_backend.engine import VllmError
from tests.vllm_backend.vllm_python import vllm_python_or_skip

pytestmark = pytest.mark.timeout(600)
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three colours."}],
         [{"role": "user", "content": "Janet has 3 apples and buys 2 more. How many apples does she have?"}],
         "The quick brown fox"]


def _spec(tmp_path, python: str, **engine):
    return spec_from_dict({"name": "v", "model": {"source": "smollm2-135m-instruct", "dtype": "float32"},
                           "input": {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt"},
                           "engine": {"backend": "vllm", "vllm_python": python, "max_num_seqs": 8,
                                      "max_model_len": 512, **engine},
                           "output": {"url": str(tmp_path / "out")}})


@pytest.fixture(scope="module")
def vllm_engine(tmp_path_factory):
    """One vLLM process for the module (a start is ~20 s): (engine, spec); the last test replaces it."""
    python = vllm_python_or_skip()
    spec = _spec(tmp_path_factory.mktemp("vllm"), python)
    held = [build_engine(spec), spec]
    yield held
    held[0].close()


def _run(engine, prompts, params, **kwargs) -> dict:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, **kwargs)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return {(o.request_id, o.sample_index): o for o in outputs}


def test_the_same_rows_give_our_engine_s_tokens(vllm_engine):
    engine, _ = vllm_engine
    assert missing_members(engine) == [] and isinstance(engine, WorkerEngine)
    assert engine.model_info["backend"] == "vllm" and engine.model_info["vllm_version"]
    params = SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.1)
    theirs = _run(engine, CHATS, params)
    from jobrunner.engine.llm_engine import LLMEngine

    ours = LLMEngine.from_source("smollm2-135m-instruct", dtype="float32",
                                 config=EngineConfig(max_num_seqs=8)).generate(CHATS, params)
    assert [theirs[(f"r{i}", 0)].prompt_token_ids for i in range(4)] == [o.prompt_token_ids for o in ours]
    assert [theirs[(f"r{i}", 0)].output_token_ids for i in range(4)] == [o.output_token_ids for o in ours]
    for out in theirs.values():
        m = out.metrics.to_dict()
        assert out.finish_reason in ("stop", "length") and m["num_output_tokens"] == len(out.output_token_ids)
        assert 0 <= m["queue_s"] <= m["ttft_s"] <= m["e2e_s"] and m["itl_mean_s"] > 0
        assert m["num_prompt_tokens"] == len(out.prompt_token_ids)


def test_samples_logprobs_stops_and_a_schema(vllm_engine):
    engine, _ = vllm_engine
    out = _run(engine, CHATS[:1], SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=2, logprobs=2))
    assert sorted(out) == [("r0", 0), ("r0", 1)]
    assert out[("r0", 1)].metrics.prompt_shared and not out[("r0", 0)].metrics.prompt_shared
    for sample in out.values():
        assert sample.num_samples == 2 and len(sample.logprobs) == len(sample.output_token_ids)
        assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in sample.logprobs)
        assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in sample.logprobs)
    stopped = _run(engine, CHATS[1:2], SamplingParams(max_tokens=40, temperature=0.0, stop=(",",)))[("r0", 0)]
    assert stopped.finish_reason == "stop" and "," not in stopped.text
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    shaped = _run(engine, CHATS[2:3], SamplingParams(max_tokens=40, temperature=0.0, json_schema=schema))
    assert isinstance(json.loads(shaped[("r0", 0)].text)["answer"], int)


def test_bad_rows_come_back_as_error_outputs(vllm_engine):
    engine, _ = vllm_engine
    long_prompt = "word " * 600  # past max_model_len 512
    out = _run(engine, [long_prompt, "", CHATS[0]], SamplingParams(max_tokens=4, temperature=0.0))
    assert out[("r0", 0)].finish_reason == "error" and "vLLM refused the request" in out[("r0", 0)].error
    assert out[("r1", 0)].finish_reason == "error" and out[("r1", 0)].error == "empty prompt"
    assert out[("r2", 0)].finish_reason in ("stop", "length")
    adapter = _run(engine, [CHATS[0]], SamplingParams(max_tokens=4), adapter="a")[("r0", 0)]
    assert adapter.finish_reason == "error" and "runs the base model only" in adapter.error
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("x", "hi", SamplingParams(max_tokens=50))
        engine.add_request("x", "hi", SamplingParams(max_tokens=50))
    while engine.has_unfinished_requests():
        engine.step()


def test_a_dead_vllm_process_is_replaced(vllm_engine):
    engine, spec = vllm_engine
    engine.add_request("a", CHATS[0], SamplingParams(max_tokens=4))
    engine._proc.kill()  # the engine process dies mid-job (out of memory, a crash in a kernel)
    with pytest.raises(VllmError, match="the vLLM engine process exited"):
        engine.step()
    fresh, loaded = rebuild_engine(engine, spec)  # the worker's path after an engine failure
    vllm_engine[0] = fresh
    assert loaded and fresh is not engine
    assert _run(fresh, [CHATS[0]], SamplingParams(max_tokens=4))[("r0", 0)].finish_reason == "length"


def test_a_text_only_model_refuses_image_rows_by_name(vllm_engine):
    from tests.vision_helpers import image_input, image_prompt, make_test_image

    engine, _ = vllm_engine
    with_image = image_prompt("Describe the picture.", [image_input(make_test_image(8, 8))])
    out = _run(engine, [with_image, CHATS[0]], SamplingParams(max_tokens=2, temperature=0.0))
    assert not engine.accepts_images and out[("r0", 0)].finish_reason == "error"
    assert out[("r0", 0)].error == "1 image(s) in the prompt, but the model (LlamaForCausalLM) takes no images in vLLM"
    assert out[("r1", 0)].error is None
