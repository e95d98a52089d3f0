"""Images through engine.backend vllm, the parts that need no vLLM (issue 49): what the prompt's chat template
sees, and the pixels as they cross the pipe to vLLM's process (decoded there by server.py's own function)."""

from __future__ import annotations

import base64
import importlib.util
import json

from jobrunner.vllm_backend.images import count_image_tokens, image_payload, template_messages
from tests.vision_helpers import image_input, image_prompt, make_test_image, make_vlm_tokenizer


def _server_module():
    """server.py as vLLM's Python runs it (it imports no jobrunner; its image decoding needs only PIL)."""
    from jobrunner.vllm_backend import server

    spec = importlib.util.spec_from_file_location("vllm_server_copy", server.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_image_parts_become_the_templates_placeholder():
    image = image_input(make_test_image(40, 24, 3))
    prompt = [{"role": "system", "content": "Be brief."}, *image_prompt("What is shown?", [image, image])]
    assert template_messages(prompt) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "What is shown?"}]}]
    assert template_messages("plain text") == "plain text"
    tokenizer = make_vlm_tokenizer()  # SmolVLM's chat template: one <image> per image part
    text = tokenizer.apply_chat_template(template_messages(prompt), tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>System: Be brief.<end_of_utterance>\nUser:<image><image>What is shown?" \
                   "<end_of_utterance>\nAssistant:"


def test_pixels_cross_the_pipe_unchanged():
    rgb = make_test_image(37, 21, 5)
    rgba = make_test_image(16, 9, 6).convert("RGBA")
    payload = image_payload([image_input(rgb, "a.png"), image_input(rgba, "b.png")])
    payload = json.loads(json.dumps(payload))  # as the pipe carries it
    assert [(p["width"], p["height"]) for p in payload] == [(37, 21), (16, 9)]
    assert len(base64.b64decode(payload[0]["rgb"])) == 37 * 21 * 3
    server = _server_module()
    decoded = [server._pil_image(p) for p in payload]
    assert decoded[0].mode == "RGB" and decoded[0].tobytes() == rgb.tobytes()
    assert decoded[1].tobytes() == rgba.convert("RGB").tobytes()
    assert payload[0]["digest"] == image_input(rgb).digest


def test_an_image_rows_failure_in_vllms_processing_is_that_rows():
    server = _server_module()
    with_images = {"op": "add", "images": [{"digest": "d"}]}
    assert server._is_request_error(RuntimeError("Expected there to be 1 prompt updates"), with_images)
    assert not server._is_request_error(RuntimeError("Expected there to be 1 prompt updates"), {"op": "add"})
    assert server._is_request_error(ValueError("too long"), {"op": "add"})

    class EngineDeadError(RuntimeError):
        pass

    assert not server._is_request_error(EngineDeadError("dead"), with_images)


def test_image_tokens_are_counted_by_the_models_image_token_id():
    class Config:
        image_token_id = 7

    class Gemma3Like:
        image_token_index = 9

    server = _server_module()  # vLLM's process reads the id from the model's config
    assert server._image_token_id(Config()) == 7 and server._image_token_id(Gemma3Like()) == 9
    assert server._image_token_id(object()) is None
    assert count_image_tokens([1, 7, 7, 7, 2, 7], 7) == 4 and count_image_tokens([1, 7], None) == 0


def test_a_processors_chat_template_is_found_beside_the_tokenizer(tmp_path):
    import json as json_module

    from jobrunner.vllm_backend.build import processor_chat_template

    assert processor_chat_template(tmp_path) is None
    (tmp_path / "chat_template.json").write_text(json_module.dumps({"chat_template": "{{ messages }}"}))
    assert processor_chat_template(tmp_path) == "{{ messages }}"  # SmolVLM's Hub layout: the tokenizer skips it
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['role'] }}{% endfor %}")
    assert processor_chat_template(tmp_path).startswith("{% for m in messages %}")
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "chat_template.json").write_text("[1, 2]")
    assert processor_chat_template(tmp_path) is None


def test_vllms_error_messages_come_on_one_line():
    from jobrunner.vllm_backend.engine import one_line

    pydantic_like = ("ValidationError: 1 validation error for ModelConfig\n  Value error, User-specified "
                     "max_model_len (4096) is greater than the derived max_model_len (1024)\n")
    assert one_line(pydantic_like) == ("ValidationError: 1 validation error for ModelConfig | Value error, "
                                       "User-specified max_model_len (4096) is greater than the derived "
                                       "max_model_len (1024)")
    assert one_line("x" * 900, 10) == "xxxxxxxxxx..." and one_line(None) == "None"
