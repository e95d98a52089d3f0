"""A row's images as written: OpenAI content parts in chat messages, and the values of an image column.

Message content is a string, or a list of parts in OpenAI's form: ``{"type": "text", "text": ...}`` and
``{"type": "image_url", "image_url": {"url": ...}}`` (the plain ``"image_url": "<url>"`` form and the
Responses API's ``input_text`` / ``input_image`` types are read too). Parts become the engine's form
(engine/images.py): text parts, and image parts ``{"type": "image", "image": ImageRef}`` that the worker
fetches just before the row enters the engine (io/images.py). A content list of text parts only becomes one
string (the parts joined with newlines), as before images existed.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from jobrunner.io.images import ImageRef

TEXT_TYPES = ("text", "input_text")
IMAGE_TYPES = ("image_url", "input_image")


def parse_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content as a string, or as text and image parts (ValueError naming ``where`` and the part)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise ValueError(f"{where}: content must be a string or a non-empty list of parts")
    parts = [_part(p, f"{where}[{i}]") for i, p in enumerate(content)]
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_TYPES and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind in IMAGE_TYPES:
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if isinstance(url, str) and url.strip():
            return {"type": "image", "image": ImageRef(url.strip(), where)}
        raise ValueError(f"{where}: an image_url part needs image_url.url (a data:, http(s), storage URL or path)")
    if kind in TEXT_TYPES:
        raise ValueError(f"{where}: a text part needs a string 'text'")
    raise ValueError(f"{where}: part type {kind!r} is not supported (text or image_url)")


def column_refs(value: Any, column: str) -> list[ImageRef]:
    """The images of an image column's cell: bytes, a URL / path string, Hugging Face's ``{bytes, path}``
    struct, or a list of those (also as a JSON array string); null or an empty list is none (ValueError names
    the column and the entry). The cell may be an Arrow scalar (the worker's rows: see :func:`arrow_cells`):
    image bytes then stay in the Arrow buffer (a memoryview) until the image is fetched."""
    if isinstance(value, pa.Scalar):
        value = (list(value.values) if isinstance(value, pa.ListScalar | pa.LargeListScalar) else value) \
            if value.is_valid else None
    if isinstance(value, str) and value.lstrip().startswith("["):  # a JSON array of URLs / paths (a CSV cell)
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"image_column {column!r}: a value starting with '[' is not a JSON array") from None
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    refs = []
    for i, item in enumerate(items):
        where = f"image_column {column!r}[{i}]" if isinstance(value, (list, tuple)) else f"image_column {column!r}"
        ref = _column_value(item)
        if ref is None:
            raise ValueError(f"{where}: {type(item).__name__} is not an image (bytes, a URL or a path)")
        refs.append(ImageRef(ref, where))
    return refs


def _column_value(item: Any) -> str | bytes | memoryview | None:
    if isinstance(item, pa.Scalar):
        item = _scalar_value(item)
    if isinstance(item, dict):  # Hugging Face datasets' Image feature: {bytes, path}
        item = item.get("bytes") or item.get("path")
    if isinstance(item, memoryview) and item.nbytes:
        return item
    if isinstance(item, (bytes, bytearray)) and item:
        return bytes(item)
    if isinstance(item, str) and item.strip():
        return item.strip()
    return None


def _scalar_value(item: pa.Scalar) -> Any:
    """An Arrow cell's image value without copying bytes: a memoryview of a binary value's buffer."""
    if not item.is_valid:
        return None
    if isinstance(item, pa.StructScalar):
        data = item.get("bytes")
        return _scalar_value(data) if data is not None and data.is_valid else _scalar_value(item.get("path"))
    if pa.types.is_binary(item.type) or pa.types.is_large_binary(item.type):
        return memoryview(item.as_buffer())
    return item.as_py()


def arrow_cells(table: pa.Table, column: str) -> list[pa.Scalar]:
    """The cells of an image column as Arrow scalars, in table order (no image bytes copied)."""
    values = table.column(column)
    return [values[i] for i in range(len(values))]


def with_images(prompt: str | list[dict[str, Any]], refs: list[ImageRef]) -> str | list[dict[str, Any]]:
    """``prompt`` with ``refs`` put first in its first user message (a text prompt becomes that message)."""
    if not refs:
        return prompt
    images = [{"type": "image", "image": r} for r in refs]
    if isinstance(prompt, str):
        return [{"role": "user", "content": [*images, {"type": "text", "text": prompt}]}]
    out = [dict(m) for m in prompt]
    for message in out:
        if message.get("role") == "user":
            content = message.get("content")
            text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
            message["content"] = images + text
            return out
    return [*out, {"role": "user", "content": images}]


def parts_text(content: list[Any]) -> str:
    """Content parts as one text: text parts as they are, an image as ``[image: <source>]``, newline-joined."""
    return "\n".join(p.get("text", "") if p.get("type") == "text" else f"[image: {_source(p.get('image'))}]"
                     for p in content if isinstance(p, dict))


def _source(image: Any) -> str:
    return str(getattr(image, "source", "") or "")


def count_images(prompt: Any) -> int:
    """How many image parts a prompt has (fetched or not)."""
    if not isinstance(prompt, list):
        return 0
    return sum(1 for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), list)
               for p in m["content"] if isinstance(p, dict) and p.get("type") == "image")


def check_count(prompt: Any, limit: int) -> int:
    """The prompt's number of images; ValueError when over ``limit`` (input.max_images_per_row)."""
    num = count_images(prompt)
    if num > limit:
        raise ValueError(f"{num} images, over input.max_images_per_row={limit}")
    return num
