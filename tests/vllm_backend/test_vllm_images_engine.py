"""Images through engine.backend vllm, for real (vLLM's CPU build, the tiny random SmolVLM): the same prompt ids
and greedy tokens as transformers' own ``generate`` with the model's processor on 8 rows (one image, two images,
large and small ones, text only); the same image again is a prefix-cache hit, another image under the same
text is not; a row whose images vLLM cannot process is that row's error. Heavy: a vLLM start is ~30 s."""

from __future__ import annotations

import pytest

from jobrunner.driver.engine_factory import build_engine
from jobrunner.engine import SamplingParams
from jobrunner.spec import spec_from_dict
from tests.vision_helpers import image_input, image_prompt, make_test_image
from tests.vllm_backend.vllm_python import vllm_python_or_skip
from tests.vllm_backend.vlm_dirs import build_vllm_smolvlm, hf_generate

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(900)]
MAX_TOKENS = 12


def _images():
    sizes = [(40, 24), (32, 32), (64, 64), (20, 70), (100, 30), (16, 16), (48, 40)]
    return [image_input(make_test_image(w, h, seed), f"img{seed}.png") for seed, (w, h) in enumerate(sizes)]


def _prompts(images):
    return [image_prompt("Describe the picture in one sentence.", [images[0]]),
            image_prompt("What colour is the square in the image?", [images[1]]),
            image_prompt("Describe the picture in one sentence.", [images[2]]),
            image_prompt("Read the text in this document and list the totals.", [images[3], images[4]]),
            image_prompt("Describe the picture in one sentence.", [images[5]]),
            [{"role": "system", "content": [{"type": "text", "text": "Answer briefly."}]},
             *image_prompt("What colour is the square in the image?", [images[6]])],
            [{"role": "user", "content": [{"type": "text", "text": "The cat sat on the mat."}]}],
            image_prompt("Describe the picture in one sentence.", [images[0]])]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(engine, model dir): one vLLM process on the tiny SmolVLM for the module."""
    python = vllm_python_or_skip()
    model_dir = build_vllm_smolvlm(tmp_path_factory.mktemp("smolvlm_vllm"))
    out = tmp_path_factory.mktemp("vlm_job")
    spec = spec_from_dict({"name": "v", "model": {"source": str(model_dir), "dtype": "float32"},
                           "input": {"url": str(out / "in.parquet"), "prompt_column": "prompt"},
                           "engine": {"backend": "vllm", "vllm_python": python, "max_num_seqs": 8,
                                      "max_model_len": 1024, "block_size": 32},
                           "output": {"url": str(out / "out")}})
    engine = build_engine(spec)
    yield engine, model_dir
    engine.close()


def _run(engine, prompts, params):
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return {o.request_id: o for o in outputs}


def test_greedy_tokens_equal_transformers_generate(vlm):
    engine, model_dir = vlm
    assert engine.accepts_images and engine.model_info["architecture"] == "Idefics3ForConditionalGeneration"
    prompts = _prompts(_images())
    theirs = _run(engine, prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    reference = hf_generate(model_dir, prompts, MAX_TOKENS)
    for i, (prompt_ids, output_ids) in enumerate(reference):
        out = theirs[f"r{i}"]
        assert out.error is None, out.error
        assert out.prompt_token_ids == prompt_ids, f"row {i}: prompt ids"
        assert out.output_token_ids == output_ids, f"row {i}: greedy tokens"
    distinct = {tuple(theirs[f"r{i}"].output_token_ids) for i in range(8)}
    assert len(distinct) >= 3  # the images matter to the tokens (the tiny model's vision weights are not tiny)
    image_token = engine.image_token_id
    image_tokens = [sum(t == image_token for t in theirs[f"r{i}"].prompt_token_ids) for i in range(8)]
    assert image_tokens[1] == 5 * 16  # resized to 64 px: 2 x 2 tiles and the global one, 16 tokens each
    assert image_tokens[6] == 0 and image_tokens[3] > image_tokens[0] > 0  # text only; two images
    assert [theirs[f"r{i}"].metrics.num_image_tokens for i in range(8)] == image_tokens
    assert [theirs[f"r{i}"].metrics.num_images for i in range(8)] == [1, 1, 1, 2, 1, 1, 0, 1]


SYSTEM = {"role": "system", "content": [{"type": "text", "text": "The cat sat on the mat and looked at the bird "
                                                                  "outside the window. Describe the picture."}]}


def test_the_same_image_again_is_a_prefix_cache_hit_another_is_not(vlm):
    engine, _ = vlm
    images = _images()
    params = SamplingParams(max_tokens=2, temperature=0.0)
    same_size = image_input(make_test_image(64, 64, 99), "other.png")  # another picture, the same token ids
    first, again, other = (_run(engine, [[SYSTEM, *image_prompt("Describe the picture.", [image])]], params)["r0"]
                           for image in (images[2], images[2], same_size))
    assert first.prompt_token_ids == again.prompt_token_ids == other.prompt_token_ids
    block, num_prompt = engine.block_size, len(first.prompt_token_ids)
    print(f"prompt {num_prompt} tokens, block {block}: cached first {first.metrics.num_cached_tokens}, "
          f"again {again.metrics.num_cached_tokens}, other image {other.metrics.num_cached_tokens}")
    assert first.metrics.num_cached_tokens == 0
    assert again.metrics.num_cached_tokens == (num_prompt - 1) // block * block  # every full block but the last
    # the blocks before the first image token hold only text: another image hits those, no more
    before_image = first.prompt_token_ids.index(engine.image_token_id)
    assert other.metrics.num_cached_tokens == before_image // block * block > 0


DROPS_IMAGES = ("{% for m in messages %}{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}"
                "{% endif %}{% endfor %}{% endfor %}")


def test_a_row_vllm_cannot_process_is_that_rows_error(vlm):
    engine, _ = vlm
    image = _images()[0]
    prompt = image_prompt("Describe the picture in one sentence.", [image])
    params = SamplingParams(max_tokens=3, temperature=0.0)
    engine.chat_template = DROPS_IMAGES  # a template without the image placeholder: vLLM's processor refuses
    try:
        engine.add_request("bad", prompt, params)
    finally:
        engine.chat_template = None
    outputs = _run(engine, [prompt], params)
    assert outputs["bad"].finish_reason == "error" and "vLLM refused the request" in outputs["bad"].error
    assert "prompt replacement" in outputs["bad"].error
    assert outputs["r0"].error is None and len(outputs["r0"].output_token_ids) > 0  # the engine goes on
