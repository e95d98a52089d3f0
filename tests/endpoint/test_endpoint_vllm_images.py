"""engine.backend openai with images against a real OpenAI-compatible server: vLLM's own server on the tiny random
SmolVLM (head_dim 32, float32, CPU) takes each row's images as the data-URL ``image_url`` parts we send: the
usage it reports counts the prompt as transformers' processor expands it (so the images arrived and were made
into image tokens), and its greedy texts are transformers' own ``generate``'s. Heavy: vLLM's server starts in
about a minute on this machine."""

from __future__ import annotations

import time

import pytest

from jobrunner.endpoint_backend.engine import EndpointConfig, EndpointEngine
from jobrunner.endpoint_backend.transport import Transport
from jobrunner.engine.sampling_params import SamplingParams
from tests.endpoint.server import start_vllm_server
from tests.vision_helpers import image_input, image_prompt, make_test_image
from tests.vllm_backend.vllm_python import vllm_python_or_skip
from tests.vllm_backend.vlm_dirs import build_vllm_smolvlm, hf_generate

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(900)]
MAX_TOKENS = 8


def test_image_rows_through_vllms_server_are_its_processors_prompts_and_transformers_tokens(tmp_path, monkeypatch):
    python = vllm_python_or_skip()
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # the server asks 2048, the tiny model says 1024
    model_dir = build_vllm_smolvlm(tmp_path / "smolvlm")
    sizes = [(40, 24), (64, 64), (20, 70), (32, 32)]
    images = [image_input(make_test_image(w, h, seed), f"img{seed}.png") for seed, (w, h) in enumerate(sizes)]
    prompts = [image_prompt("Describe the picture in one sentence.", [images[0]]),
               image_prompt("What colour is the square in the image?", [images[1]]),
               image_prompt("Read the text in this document and list the totals.", [images[2], images[3]])]
    server = start_vllm_server(python, str(model_dir), threads=1, max_num_seqs=4)
    try:
        config = EndpointConfig(base_url=server.url, model=server.model, max_concurrency=3, backoff_base_s=0.05)
        engine = EndpointEngine(config, Transport(server.url, None, config.timeout_s))
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
        outputs, deadline = {}, time.monotonic() + 300
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the server did not answer every row"
            outputs.update({o.request_id: o for o in engine.step()})
        engine.close()
    finally:
        server.stop()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    for i, (prompt_ids, output_ids) in enumerate(hf_generate(model_dir, prompts, MAX_TOKENS)):
        out = outputs[f"r{i}"]
        assert out.error is None, out.error
        assert out.metrics.num_prompt_tokens == len(prompt_ids), f"row {i}: the images' tokens at the server"
        assert out.metrics.num_output_tokens == len(output_ids), f"row {i}"
        expected = tokenizer.decode(output_ids, skip_special_tokens=True)
        if "\ufffd" not in expected:  # a random model's partial UTF-8 bytes: vLLM holds them back
            assert out.text == expected, f"row {i}"
