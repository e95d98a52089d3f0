"""A job's images on the worker side: which rows can carry them, how a worker reads them (the row's input file,
the job's limits and storage options), how they enter fingerprints, and their counts in output rows. The
fetching itself is io's (io/images.py); this module turns the spec into its settings."""

from __future__ import annotations

from typing import Any

from jobrunner.engine.images import ImageInput
from jobrunner.io.image_prints import ImagePrints
from jobrunner.io.images import DecodedImage, ImageContext, ImageLimits, base_of
from jobrunner.spec import JobSpec


def _is_openai_batch(spec: JobSpec) -> bool:
    return spec.input.format == "openai_batch"


def can_carry_images(spec: JobSpec) -> bool:
    """Whether the job's rows can hold images: an image column, chat messages, or OpenAI batch lines."""
    inp = spec.input
    return bool(inp.image_column or inp.messages_column or _is_openai_batch(spec))


def has_images(spec: JobSpec) -> bool:
    """Whether rows can carry images (an image column, chat messages or OpenAI batch lines, generating), so the
    output has ``num_images`` and ``num_image_tokens``."""
    return can_carry_images(spec) and spec.task == "generate"


def image_prints(spec: JobSpec) -> ImagePrints | None:
    """How a row's images named by URL or path enter its request fingerprint (io/image_prints.py): by content
    (input.image_fingerprint content, the default), or None (by name only: the columns' values)."""
    inp = spec.input
    if inp.image_fingerprint != "content" or not can_carry_images(spec):
        return None
    chat = "body" if _is_openai_batch(spec) else inp.messages_column
    return ImagePrints(chat_column=chat, is_openai=_is_openai_batch(spec), image_column=inp.image_column,
                       storage_options=dict(inp.storage_options), limits=image_limits(spec))


def image_context(spec: JobSpec, file_url: str, prints: ImagePrints | None) -> ImageContext | None:
    """How a worker reads the images of the rows of ``file_url`` (recording their digests in ``prints``);
    None when the job's rows cannot carry images (a prompt column without an image column)."""
    inp = spec.input
    if not can_carry_images(spec):
        return None
    if prints is not None:
        return prints.with_wrap(file_url, engine_image)
    return ImageContext(dict(inp.storage_options), base_of(file_url), image_limits(spec), wrap=engine_image)


def engine_image(image: DecodedImage) -> ImageInput:
    """A fetched image as the engine takes it (engine/images.py)."""
    return ImageInput(data=image.data, digest=image.digest, mime=image.mime, source=image.source,
                      pixels=image.pixels)


def bytes_image_column(spec: JobSpec, table: Any) -> str | None:
    """The image column of ``table`` (a shard's Arrow table) when it holds image bytes (binary, a list or
    struct of binary): the worker keeps those in the Arrow table instead of copying a shard's images into
    Python rows (io/image_parts.py arrow_cells)."""
    column = spec.input.image_column
    if column is None or column not in table.column_names:
        return None
    return column if "binary" in str(table.schema.field(column).type) else None


def image_limits(spec: JobSpec) -> ImageLimits:
    """The job's limits on one image."""
    return ImageLimits(spec.input.image_max_bytes, spec.input.image_max_pixels)


def image_tokens(out: Any, metrics: dict[str, Any]) -> int | None:
    """The prompt tokens that stand for the request's images, as the engine reports them (None: it does not)."""
    value = metrics.get("num_image_tokens")
    value = getattr(out, "num_image_tokens", None) or value  # an engine may report it beside its metrics
    return None if value is None else int(value)
