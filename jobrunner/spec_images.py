"""The image keys of the job spec's input section (issue 49): which column holds a row's images, and the
limits a worker checks each image against (io/images.py). Declared once here with ``setting(...)``; spec.py
builds its fields from them (spec_sections.py), so spec.py stays short and this module needs no pydantic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jobrunner.engine.settings import setting


@dataclass(frozen=True)
class ImageSettings:
    """input.image_column and the image limits (mixed into InputSpec)."""

    image_column: str | None = setting(
        None,
        description="Optional column of each row's images: bytes, or a URL / path string (data:, http(s)://, "
        "s3:// and other storage URLs read with input.storage_options, a local path; a relative path is "
        "relative to the input file's folder), or a list of them, or Hugging Face's {bytes, path} struct. The "
        "images go first in the row's user message, then its text. Null or an empty list: no image.",
    )
    image_max_bytes: int = setting(
        20 * 1024 * 1024, ge=1,
        description="Largest encoded image (bytes); a larger one makes its row an error row naming the image.",
    )
    image_max_pixels: int = setting(
        25_000_000, ge=1,
        description="Most pixels (width x height) of one image, checked before decoding; a larger one makes its "
        "row an error row naming the image.",
    )
    max_images_per_row: int = setting(
        16, ge=1,
        description="Most images one row may carry (image column and message parts together); more makes the "
        "row an error row.",
    )
    image_fingerprint: Literal["content", "reference"] = setting(
        "content",
        description="What a row's request fingerprint (incremental runs' changed-prompt check, output.dedupe "
        "prompts) holds of an image given by URL or path: content = the SHA-256 of its bytes (planning reads "
        "each such image once where it needs fingerprints), reference = the URL / path text (no reads at "
        "planning; a changed image under the same name goes unnoticed). Inline images (bytes, data: URLs) are "
        "always hashed by content.",
    )
