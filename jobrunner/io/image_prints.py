"""The content of a row's referenced images, as a part of its request fingerprint (io/fingerprints.py).

A row's request fingerprint hashes its request columns as values. An image given inline (bytes in an image
column, a ``data:`` URL in a message) is thereby hashed by its content. An image given by reference (a
storage URL, http(s) URL or path) is hashed only by its name that way; with ``input.image_fingerprint:
content`` (the default) the SHA-256 of each referenced image's bytes is mixed in as well (role
``image_content``), so a changed image under an unchanged name is a changed request.

Cost: planning reads each referenced image once where it needs fingerprints (an incremental run: only the
rows whose id is done, to compare them; ``output.dedupe: prompts``: every row), on FETCH_THREADS threads;
the worker reads none again for the fingerprint (it records the digest of every image it fetched for the
engine) except for rows that never reached the engine. An image that cannot be read counts as the text
``unreadable:<url>`` (planning and worker alike). ``input.image_fingerprint: reference`` skips all of this.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from jobrunner.io.image_parts import IMAGE_TYPES, column_refs, parse_content
from jobrunner.io.images import FETCH_THREADS, ImageContext, ImageError, ImageLimits, base_of, image_digest, resolve_url

_MARKERS = "|".join(IMAGE_TYPES)  # a text cell that holds none of these names has no image part


@dataclass
class ImagePrints:
    """What hashing a table's referenced images needs: where images are (the messages column or the OpenAI
    body column, the image column), how to read them, and the digests already known (resolved URL -> hex)."""

    chat_column: str | None = None  # a messages column, or "body" for OpenAI batch lines
    is_openai: bool = False
    image_column: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    limits: ImageLimits = ImageLimits()
    digests: dict[str, str] = field(default_factory=dict)  # filled by the worker's fetches too

    def context(self, file_url: str) -> ImageContext:
        """How to read the images of a row of ``file_url`` (relative paths: beside it), recording digests."""
        return ImageContext(self.storage_options, base_of(file_url), self.limits, self.digests)

    def with_wrap(self, file_url: str, wrap: Any) -> ImageContext:
        """:meth:`context` whose images become ``wrap(DecodedImage)`` (the worker's ImageInput)."""
        return replace(self.context(file_url), wrap=wrap)

    def row_hashes(self, table: pa.Table, file_url: str) -> np.ndarray:
        """uint64 [rows]: a hash of each row's referenced images' digests, in order; 0 for a row without."""
        refs = self._references(table)
        ctx = self.context(file_url)
        urls = sorted({resolve_url(v, ctx.base_url) for row in refs for v in row})
        missing = [u for u in urls if u not in self.digests]
        threads = min(FETCH_THREADS, len(missing))
        if missing:
            with ThreadPoolExecutor(max_workers=threads) as pool:
                for url, digest in zip(missing, pool.map(lambda u: _digest(u, ctx), missing), strict=True):
                    self.digests[url] = digest
        out = np.zeros(table.num_rows, np.uint64)
        for i, row in enumerate(refs):
            if row:
                joined = "|".join(self.digests[resolve_url(v, ctx.base_url)] for v in row)
                out[i] = np.uint64(int.from_bytes(hashlib.sha256(joined.encode()).digest()[:8], "little") or 1)
        return out

    def _references(self, table: pa.Table) -> list[list[str]]:
        """Each row's images given by reference (not bytes, not data: URLs), in order: messages, then column."""
        out: list[list[str]] = [[] for _ in range(table.num_rows)]
        if self.chat_column and self.chat_column in table.column_names:
            column = table.column(self.chat_column)
            for i in _candidates(column).tolist():
                out[i] += _chat_values(column[i].as_py(), self.is_openai)
        if self.image_column and "string" in str(table.schema.field(self.image_column).type if
                                                  self.image_column in table.column_names else ""):
            for i, cell in enumerate(table.column(self.image_column).to_pylist()):
                out[i] += _column_values(cell, self.image_column)
        return [[v for v in row if isinstance(v, str) and not v.startswith("data:")] for row in out]


def _digest(url: str, ctx: ImageContext) -> str:
    try:
        return image_digest(url, ctx)
    except ImageError:
        return hashlib.sha256(f"unreadable:{url}".encode()).hexdigest()


def _candidates(column: pa.ChunkedArray) -> np.ndarray:
    """Rows whose cell may hold an image part: a text cell naming an image part type; any row of a nested
    column whose type has an image_url field."""
    kind = column.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        found = pc.fill_null(pc.match_substring_regex(column, _MARKERS), False)
        return np.flatnonzero(np.asarray(found.to_numpy(zero_copy_only=False), dtype=bool))
    if "image_url" in str(kind):
        return np.arange(len(column))
    return np.zeros(0, np.int64)


def _chat_values(cell: Any, is_openai: bool) -> list[Any]:
    """The image values in a messages cell or an OpenAI body (an unreadable cell has none: its row fails
    anyway, and its text is hashed as a value)."""
    try:
        messages = json.loads(cell) if isinstance(cell, str) else cell
        if is_openai:
            messages = messages.get("messages") if isinstance(messages, dict) else None
        values = []
        for i, m in enumerate(messages or []):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                parsed = parse_content(content, f"messages[{i}]")
                values += [p["image"].value for p in parsed if isinstance(p, dict) and p["type"] == "image"]
        return values
    except (ValueError, TypeError, AttributeError):
        return []


def _column_values(cell: Any, column: str) -> list[Any]:
    try:
        return [r.value for r in column_refs(cell, column)]
    except ValueError:
        return []
