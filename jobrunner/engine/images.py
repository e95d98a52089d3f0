"""Images in prompts: the one type an image has on its way from a row to an engine.

The worker fetches and decodes each image of a row (``jobrunner/io/images.py``: data URLs, storage URLs, local
paths, http(s), bytes in an image column) under the job's limits, and hands the engine a chat prompt whose
message content parts are ``{"type": "text", "text": ...}`` and ``{"type": "image", "image": ImageInput}``.
Every backend reads images only from such parts: ours runs the vision encoder on ``ImageInput.pixels``, vLLM
receives the PIL image, an OpenAI-compatible endpoint gets a ``data:`` URL of ``ImageInput.data``.

``digest`` (the SHA-256 of the image's encoded bytes) is what identifies an image everywhere: the prefix cache
keys image tokens by it, and the row's fingerprint (resume, incremental "changed prompt") includes it.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ImageInput:
    """One decoded image of a request.

    ``data``: the encoded bytes as fetched (PNG, JPEG, WebP...); ``digest``: their SHA-256, hex; ``mime``: the
    decoded format's MIME type (``image/png``); ``source``: where it came from, for error messages (a URL, a
    path, ``image_column[2]``); ``pixels``: the decoded RGB ``PIL.Image.Image``.
    """

    data: bytes = field(repr=False)
    digest: str
    mime: str
    source: str
    pixels: Any = field(repr=False, compare=False)

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        return tuple(self.pixels.size)

    def data_url(self) -> str:
        """The image as a ``data:`` URL (what an OpenAI-compatible endpoint takes)."""
        return f"data:{self.mime};base64,{base64.b64encode(self.data).decode('ascii')}"


def prompt_images(prompt: Any) -> list[ImageInput]:
    """The images of a prompt, in order of appearance (empty for text and token-id prompts)."""
    if isinstance(prompt, str) or not isinstance(prompt, Sequence):
        return []
    found = []
    for message in prompt:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            found += [p["image"] for p in content if isinstance(p, dict) and p.get("type") == "image"]
    return found
