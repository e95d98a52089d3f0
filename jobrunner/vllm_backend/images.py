"""Images of a prompt on their way to vLLM's process (issue 49, "through vLLM").

A prompt with images is a chat whose content parts include ``{"type": "image", "image": ImageInput}``
(engine/images.py). Its token ids are made as for text rows (the model's chat template, our tokenizer), with each
image part rendered as the template's own image placeholder (``{"type": "image"}``: ``<image>`` for Idefics3,
``<start_of_image>`` for Gemma 3); vLLM's multi-modal processor expands each placeholder into the image's tokens
and runs the vision encoder on the pixels it receives beside the ids. The pixels cross the pipe as the decoded
RGB bytes the worker made (not the encoded file), so vLLM sees exactly what our engine sees; the image's content
hash goes as vLLM's multi-modal UUID, the key of its processor, encoder and prefix caches.
"""

from __future__ import annotations

import base64
from typing import Any

from jobrunner.engine.images import ImageInput


def template_messages(prompt: Any) -> Any:
    """The prompt with each image part as a bare ``{"type": "image"}`` (what chat templates render as the
    model's image placeholder); text prompts and messages without images are returned as they are."""
    if isinstance(prompt, str) or not isinstance(prompt, (list, tuple)):
        return prompt
    return [_template_message(m) for m in prompt]


def _template_message(message: Any) -> Any:
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    parts = [{"type": "image"} if isinstance(p, dict) and p.get("type") == "image" else p for p in content]
    return {**message, "content": parts}


def image_payload(images: list[ImageInput]) -> list[dict[str, Any]]:
    """The images as the ``add`` message carries them to server.py: ``{"digest", "width", "height", "rgb"}``
    with ``rgb`` the base64 of the decoded pixels (row-major, 3 bytes a pixel)."""
    out = []
    for image in images:
        pixels = image.pixels if image.pixels.mode == "RGB" else image.pixels.convert("RGB")
        width, height = pixels.size
        out.append({"digest": image.digest, "width": width, "height": height,
                    "rgb": base64.b64encode(pixels.tobytes()).decode("ascii")})
    return out


def count_image_tokens(prompt_token_ids: list[int], image_token_id: int | None) -> int:
    """How many of a prompt's ids (as vLLM expanded them) are image tokens (0 without an image token id)."""
    if image_token_id is None:
        return 0
    return sum(1 for t in prompt_token_ids if t == image_token_id)

