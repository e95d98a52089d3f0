"""SmolVLM (Idefics3) in our engine against transformers' own ``generate`` with its processor, on the tiny random
checkpoint of tests/vision_helpers.py loaded through our real loader: greedy tokens on 8/8 rows (different image
sizes, two images in a row, text before an image), whole and chunked prefill, preemption, prefix-cache hits keyed
by the image's digest; refusals that must be a row's error, never a crash."""

from __future__ import annotations

import pytest
import torch

from jobrunner.engine import EngineConfig, LLMEngine, SamplingParams, vision
from jobrunner.engine.profile import StepProfiler
from tests.vision_helpers import image_input, make_test_image

MAX_TOKENS = 6
QUESTION = "Describe the picture."

# (text before the images, image sizes, text after) per row; different sizes -> different tile grids
ROWS = [
    ("", [(50, 30)], QUESTION),
    ("", [(20, 20)], QUESTION),
    ("", [(64, 64)], "What colour is the square?"),
    ("", [(33, 70)], QUESTION),
    ("", [(40, 40)], QUESTION),
    ("", [(10, 60)], "Read the text."),
    ("", [(70, 20), (24, 24)], QUESTION),   # two images in one prompt
    ("Look at this: ", [(45, 45)], QUESTION),  # text before the image
]


def _row_images(row: int) -> list:
    return [make_test_image(w, h, seed=10 * row + k) for k, (w, h) in enumerate(ROWS[row][1])]


def _messages(row: int, images: list, for_hf: bool = False) -> list[dict]:
    before, _, after = ROWS[row]
    parts = [{"type": "text", "text": before}] if before else []
    parts += [{"type": "image"} if for_hf else {"type": "image", "image": image_input(im)} for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": after}]}]


@pytest.fixture(scope="module")
def expected(tiny_smolvlm_dir) -> list[tuple[list[int], list[int]]]:
    """transformers' (prompt ids, greedy new tokens) per row, through its processor."""
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(str(tiny_smolvlm_dir))
    model = Idefics3ForConditionalGeneration.from_pretrained(str(tiny_smolvlm_dir), dtype=torch.float32).eval()
    out = []
    for row in range(len(ROWS)):
        images = _row_images(row)
        text = processor.apply_chat_template(_messages(row, images, for_hf=True), add_generation_prompt=True)
        inputs = processor(text=[text], images=[images], return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        prompt = inputs["input_ids"][0].tolist()
        out.append((prompt, ids[0, len(prompt):].tolist()))
    return out


def _engine(model_dir, **config) -> LLMEngine:
    base = dict(device="cpu", block_size=16, num_kv_blocks=96, max_num_batched_tokens=2048)
    return LLMEngine.from_source(str(model_dir), dtype="float32", config=EngineConfig(**{**base, **config}))


def _run(engine: LLMEngine, prompts: dict[str, list]) -> dict[str, object]:
    """Add every prompt, step to the end checking the KV bookkeeping after each step; outputs by id."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
        engine.check_integrity()
    return outputs


def _all_rows() -> dict[str, list]:
    return {f"r{row}": _messages(row, _row_images(row)) for row in range(len(ROWS))}


def _check_parity(outputs: dict, expected: list) -> None:
    for row, (prompt_ids, tokens) in enumerate(expected):
        out = outputs[f"r{row}"]
        assert out.error is None
        assert out.prompt_token_ids == prompt_ids, f"row {row}: prompt token layout differs from the processor's"
        assert out.output_token_ids == tokens, f"row {row}"


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked-prefix-hit"])
def test_greedy_tokens_equal_transformers(tiny_smolvlm_dir, expected, chunked, monkeypatch):
    """Whole prompts without prefix caching (the first step's 9 images encoded in calls of at most 8 tiles);
    24-token chunks (images cut across steps) with prefix caching, row 6 run once before so that its second run
    starts on cached image blocks."""
    monkeypatch.setattr(vision, "MAX_TILES_PER_CALL", 8)
    engine = _engine(tiny_smolvlm_dir, max_num_batched_tokens=24 if chunked else 2048, enable_prefix_caching=chunked)
    rows = _all_rows()
    if chunked:
        _run(engine, {"warm": rows["r6"]})
    outputs = _run(engine, rows)
    _check_parity(outputs, expected)
    out = outputs["r6"]  # two images: 70x20 -> 2x1 tiles + the global one, 24x24 (upscaled to 64) 2x2 + 1
    assert (out.metrics.num_images, out.metrics.num_image_tokens) == (2, (3 + 5) * 16)
    assert (outputs["r1"].metrics.num_images, outputs["r1"].metrics.num_image_tokens) == (1, 5 * 16)
    stats = engine.stats()
    # once per image however many chunks its tokens took; never for the cached run of row 6
    assert stats.num_images_encoded == 9
    assert (out.metrics.num_cached_tokens > out.prompt_token_ids.index(engine.model.image_token_id)) == chunked
    assert stats.num_images == 9 + 2 * chunked
    assert stats.num_image_tokens == sum(o.metrics.num_image_tokens for o in outputs.values()) + 128 * chunked
    assert stats.vision_encoder_s > 0


def test_preemption_recomputes_images(tiny_smolvlm_dir, expected):
    rows = {k: v for k, v in _all_rows().items() if k in ("r0", "r2", "r6", "r7")}
    engine = _engine(tiny_smolvlm_dir, num_kv_blocks=20, max_num_batched_tokens=64, enable_prefix_caching=False)
    outputs = _run(engine, rows)
    for key, out in outputs.items():
        assert (out.prompt_token_ids, out.output_token_ids) == tuple(expected[int(key[1:])])
    assert engine.stats().num_preemptions > 0
    assert engine.stats().num_images_encoded > 5  # a preempted request's images were encoded again


def test_prefix_cache_keyed_by_image_digest(tiny_smolvlm_dir, expected):
    engine = _engine(tiny_smolvlm_dir)
    images = _row_images(0)
    first = _run(engine, {"a": _messages(0, images)})["a"]
    encoded = engine.stats().num_images_encoded
    again = _run(engine, {"b": _messages(0, images)})["b"]  # the same image under the same prompt: a hit
    num_tokens = len(expected[0][0])
    assert first.metrics.num_cached_tokens == 0
    assert again.metrics.num_cached_tokens == (num_tokens - 1) // 16 * 16  # every full block, image tokens too
    assert engine.stats().num_images_encoded == encoded  # its image tokens all cached: never encoded again
    assert again.output_token_ids == first.output_token_ids == expected[0][1]
    # a different picture of the same size: the same token ids, a miss from its first image block on
    other = make_test_image(50, 30, seed=99)
    changed = _run(engine, {"c": _messages(0, [other])})["c"]
    assert changed.prompt_token_ids == again.prompt_token_ids
    first_image_token = changed.prompt_token_ids.index(engine.model.image_token_id)
    assert changed.metrics.num_cached_tokens == first_image_token // 16 * 16
    assert engine.stats().num_images_encoded == encoded + 1
    fresh = _run(_engine(tiny_smolvlm_dir, enable_prefix_caching=False), {"d": _messages(0, [other])})["d"]
    assert changed.output_token_ids == fresh.output_token_ids


def test_image_requests_refused_cleanly(tiny_smolvlm_dir, tiny_llama_hf_dir):
    prompt = _messages(0, _row_images(0))
    text_model = LLMEngine.from_source(str(tiny_llama_hf_dir), dtype="float32",
                                       config=EngineConfig(device="cpu", num_kv_blocks=32))
    out = _run(text_model, {"x": prompt})["x"]
    assert out.finish_reason == "error"
    assert "LlamaForCausalLM" in out.error and "text-only model and takes no images" in out.error
    engine = _engine(tiny_smolvlm_dir)
    engine.add_request("y", prompt, SamplingParams(max_tokens=2, prompt_logprobs=1))
    out = engine.step()[0]
    assert out.finish_reason == "error" and "prompt_logprobs with images" in out.error
    text = _run(engine, {"z": [{"role": "user", "content": "Hello"}]})["z"]  # text rows still run on a VLM
    assert text.error is None and text.metrics.num_images == 0 and len(text.output_token_ids) == MAX_TOKENS
    with pytest.raises(ValueError, match="quantization 'int8' is not supported for vision-language models"):
        LLMEngine.from_source(str(tiny_smolvlm_dir), dtype="float32", quantization="int8",
                              config=EngineConfig(device="cpu", num_kv_blocks=32))


def test_profile_reports_the_vision_encoder(tiny_smolvlm_dir):
    engine = _engine(tiny_smolvlm_dir)
    with StepProfiler(engine) as profiler:
        _run(engine, {"a": _messages(6, _row_images(6))})
    parts = profiler.summary()["parts"]
    assert parts["vision"]["seconds"] > 0 and 0 < parts["vision"]["share"] < 1
