"""Images of a row: fetched from where the row says, checked against the job's limits, decoded to RGB.

A row names an image by value: its bytes (an image column of binary type), a ``data:`` URL, an ``http(s)://``
URL, any fsspec URL the job's input storage can open (``s3://``, ``gs://``, ``memory://`` ...; the input's
``storage_options`` apply), or a local path. A relative path or key is relative to the folder of the input
file that names it, so a dataset can ship ``images/`` beside its Parquet or JSONL files.

Every failure (not found, unreachable, over ``input.image_max_bytes`` or ``input.image_max_pixels``, not an
image Pillow can decode) is an :class:`ImageError` whose message names the row and the image (its position
in the row and where it came from), so the worker makes that row an error row; its shard goes on.

The images a row needs are fetched by a small thread pool in the worker (:class:`ImageFetcher`), a row at a
time just before the row enters the engine, so a shard's images are never all in memory at once.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import posixpath
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fsspec.core import url_to_fs

from jobrunner.io.storage import StorageError, retry
from jobrunner.redaction import redact_text

HTTP_TIMEOUT_S = 30.0  # one http(s) image: connect and read
FETCH_THREADS = 8  # images fetched and decoded at once per worker
_SHOWN_CHARS = 60  # of a source in messages (a data URL is cut)


class ImageError(ValueError):
    """An image that cannot be used; the message names the row and the image (credentials cut out)."""

    def __init__(self, message: str) -> None:
        super().__init__(redact_text(str(message)))


@dataclass(frozen=True)
class ImageLimits:
    """The job's limits on one image (input.image_max_bytes, input.image_max_pixels)."""

    max_bytes: int = 20 * 1024 * 1024  # the spec's defaults (spec_images.py); io imports no spec
    max_pixels: int = 25_000_000


@dataclass(frozen=True)
class ImageRef:
    """An image of a row before it is fetched: ``value`` is its bytes or a URL / path; ``where`` says where
    the row holds it (``image_column 'photo'[1]``, ``messages[0].content[2]``) for messages."""

    value: str | bytes | memoryview  # memoryview: bytes still in the shard's Arrow table (not copied)
    where: str

    @property
    def source(self) -> str:
        """Where the image comes from, short and credential-free: the URL or path (a long one cut in its middle,
        so the file's name stays), ``<N bytes>`` for bytes, a data URL's head."""
        if isinstance(self.value, (bytes, bytearray, memoryview)):
            return f"<{memoryview(self.value).nbytes} bytes>"
        text = self.value.split("?", 1)[0] if "://" in self.value else self.value  # a presigned query is a secret
        if len(text) <= _SHOWN_CHARS:
            return text
        if text.startswith("data:"):
            return text[:_SHOWN_CHARS] + "..."
        keep = _SHOWN_CHARS // 2  # a long path or URL keeps its head (bucket) and its tail (the file's name)
        return text[:keep] + "..." + text[-keep:]

    def describe(self, index: int, count: int) -> str:
        """``image 2 of 3 (s3://b/cat.png, image_column 'photo'[1])``."""
        return f"image {index + 1} of {count} ({self.source}, {self.where})"

    def __repr__(self) -> str:  # in prefix-grouping keys and debugging: never the bytes
        return f"ImageRef({self.source!r})"


@dataclass(frozen=True)
class DecodedImage:
    """One fetched and decoded image, with the fields of the engine's ``ImageInput`` (engine/images.py: io
    imports nothing of the engine, so the worker wraps it through ``ImageContext.wrap``)."""

    data: bytes = field(repr=False)
    digest: str  # SHA-256 of data, hex
    mime: str
    source: str
    pixels: Any = field(repr=False)  # RGB PIL.Image.Image

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        return tuple(self.pixels.size)


@dataclass(frozen=True)
class ImageContext:
    """What fetching needs besides the image: the input's storage options, the folder relative paths are
    resolved against (the input file's), the limits."""

    storage_options: dict[str, Any]
    base_url: str = ""
    limits: ImageLimits = ImageLimits()
    digests: dict[str, str] | None = None  # resolved URL -> SHA-256 of each image read by reference (fingerprints)
    wrap: Callable[[DecodedImage], Any] | None = None  # what a prompt's image part holds (the engine's ImageInput)


def base_of(file_url: str) -> str:
    """The folder of an input file (what a relative image path is relative to)."""
    return posixpath.dirname(file_url.split("?", 1)[0])


def load_image(ref: ImageRef, ctx: ImageContext) -> DecodedImage:
    """Fetch, check and decode one image; ImageError (without the row: the caller adds it) on any failure."""
    data = fetch_bytes(ref.value, ctx)
    digest = hashlib.sha256(data).hexdigest()
    if ctx.digests is not None and isinstance(ref.value, str) and not ref.value.startswith("data:"):
        ctx.digests[resolve_url(ref.value, ctx.base_url)] = digest  # io/image_prints.py reads it
    return decode_image(data, ref.source, ctx.limits.max_pixels, digest)


def fetch_bytes(value: str | bytes, ctx: ImageContext) -> bytes:
    """The encoded bytes of an image value (bytes, data URL, http(s) URL, storage URL or path), at most
    ``ctx.limits.max_bytes`` of them."""
    limit = ctx.limits.max_bytes
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    elif not isinstance(value, str) or not value.strip():
        raise ImageError(f"not an image: {type(value).__name__} value (give bytes, a URL or a path)")
    elif value.startswith("data:"):
        data = decode_data_url(value)
    elif value.startswith(("http://", "https://")):
        data = _fetch_http(value, limit)
    else:
        data = _fetch_storage(resolve_url(value, ctx.base_url), ctx.storage_options, limit)
    if not data:
        raise ImageError("empty image (0 bytes)")
    if len(data) > limit:
        raise ImageError(f"too large: over input.image_max_bytes={limit} bytes")
    return data


def decode_data_url(url: str) -> bytes:
    """The bytes of a ``data:[<mime>][;base64],<data>`` URL."""
    head, sep, payload = url.partition(",")
    if not sep:
        raise ImageError("data URL without a comma")
    if head.endswith(";base64"):
        try:
            return base64.b64decode(payload.strip(), validate=False)
        except (binascii.Error, ValueError) as exc:
            raise ImageError(f"data URL is not valid base64 ({exc})") from None
    return urllib.parse.unquote_to_bytes(payload)


def resolve_url(value: str, base_url: str) -> str:
    """A storage URL or path as given, or a relative one joined to the input file's folder."""
    if "://" in value or value.startswith("/") or not base_url:
        return value
    return f"{base_url.rstrip('/')}/{value}"


def _fetch_http(url: str, limit: int) -> bytes:
    request = urllib.request.Request(url, headers={"User-Agent": "jobrunner"})
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:  # noqa: S310 - user's URL
            return response.read(limit + 1)
    except urllib.error.HTTPError as exc:
        raise ImageError(f"HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ImageError(f"unreachable ({reason})") from None


def _fetch_storage(url: str, storage_options: dict[str, Any], limit: int) -> bytes:
    try:
        fs, path = url_to_fs(url, **storage_options)
    except (ImportError, ValueError) as exc:
        raise ImageError(f"cannot open {url}: {exc}") from None

    def read() -> bytes:  # one ranged GET on an object store (no HEAD first), at most one byte over the limit
        return fs.cat_file(path, start=0, end=limit + 1)

    try:
        return retry(f"read image {url}", read, attempts=3)
    except FileNotFoundError:
        raise ImageError("not found") from None
    except IsADirectoryError:
        raise ImageError("is a folder, not an image") from None
    except (OSError, StorageError) as exc:
        raise ImageError(f"cannot read: {exc}") from None


def decode_image(data: bytes, source: str, max_pixels: int, digest: str | None = None) -> DecodedImage:
    """The image of ``data`` (RGB pixels, SHA-256 of ``data``); ImageError when Pillow cannot
    read it or it has more than ``max_pixels`` pixels (checked from the header, before decoding)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise ImageError(f"too large: {width}x{height} pixels, over input.image_max_pixels={max_pixels}")
            mime = Image.MIME.get(image.format or "", "application/octet-stream")
            pixels = image.convert("RGB")  # decodes (a truncated or corrupt file fails here)
    except Image.DecompressionBombError as exc:
        raise ImageError(f"too large: {exc}") from None
    except UnidentifiedImageError:  # its text names a BytesIO object: nothing a user can act on
        raise ImageError("not a readable image (not a format Pillow knows, or not an image)") from None
    except (OSError, SyntaxError, ValueError) as exc:
        if isinstance(exc, ImageError):
            raise
        raise ImageError(f"not a readable image ({type(exc).__name__}: {str(exc)[:120]})") from None
    digest = digest or hashlib.sha256(data).hexdigest()
    return DecodedImage(data=data, digest=digest, mime=mime, source=source, pixels=pixels)


def image_digest(value: str | bytes, ctx: ImageContext) -> str:
    """The SHA-256 (hex) of an image's encoded bytes without decoding it; ImageError as fetch_bytes."""
    return hashlib.sha256(fetch_bytes(value, ctx)).hexdigest()


# ---- a row's images in the worker -------------------------------------------------------------------------
def prompt_refs(prompt: Any) -> list[ImageRef]:
    """The images of a prompt not yet fetched (message parts ``{"type": "image", "image": ImageRef}``)."""
    if not isinstance(prompt, list):
        return []
    return [p["image"] for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), list)
            for p in m["content"] if isinstance(p, dict) and isinstance(p.get("image"), ImageRef)]


def resolve_prompt(prompt: Any, row_id: str, ctx: ImageContext) -> Any:
    """``prompt`` with each ImageRef part replaced by its image (``ctx.wrap`` of the DecodedImage: the engine's
    ImageInput in a worker; a new list, ``prompt`` is unchanged); ImageError naming the row and the image at the
    first image that fails."""
    refs = prompt_refs(prompt)
    if not refs:
        return prompt
    loaded: dict[int, Any] = {}
    for index, ref in enumerate(refs):
        try:
            image = load_image(ref, ctx)
            loaded[id(ref)] = ctx.wrap(image) if ctx.wrap is not None else image
        except ImageError as exc:
            raise ImageError(f"row {row_id}: {ref.describe(index, len(refs))}: {exc}") from None
    return [_with_images(m, loaded) for m in prompt]


def _with_images(message: Any, loaded: dict[int, Any]) -> Any:
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    parts = [{"type": "image", "image": loaded[id(p["image"])]} if isinstance(p, dict) and
             isinstance(p.get("image"), ImageRef) else p for p in content]
    return {**message, "content": parts}


_ROW_IMAGE_ERROR = re.compile(r"^row .*?: image \d+ of \d+ \(.*?\): (.*)$", re.S)


def image_error_kind(error: str) -> str | None:
    """The kind of a row's image error (what summaries count), its row and image left out: ``row r4: image 2
    of 2 (x.png, image_column 'img'[1]): not found`` -> ``image: not found``; None for any other error."""
    found = _ROW_IMAGE_ERROR.match(error)
    return None if found is None else f"image: {found.group(1)}"


class ImageFetcher:
    """A worker's image fetching: rows' prompts resolved on a small thread pool, ahead of the engine.

    ``prefetch(key, prompt, row_id, ctx)`` starts resolving a prompt (once per key); ``take`` returns the
    resolved prompt (waiting for it) and forgets it, so decoded pixels live only from shortly before the row
    enters the engine until the engine lets them go. Called from one thread (the worker's engine thread)."""

    def __init__(self, threads: int = FETCH_THREADS) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._threads = threads
        self._pending: dict[Any, Future] = {}

    def prefetch(self, key: Any, prompt: Any, row_id: str, ctx: ImageContext) -> None:
        """Start resolving ``prompt`` unless it has no image or is already started."""
        if key in self._pending or not prompt_refs(prompt):
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="images")
        self._pending[key] = self._pool.submit(resolve_prompt, prompt, row_id, ctx)

    def is_ready(self, key: Any, prompt: Any) -> bool:
        """Whether ``take`` would return without waiting (no images, or fetched)."""
        future = self._pending.get(key)
        return future.done() if future is not None else not prompt_refs(prompt)

    def take(self, key: Any, prompt: Any, row_id: str, ctx: ImageContext) -> Any:
        """The resolved prompt (ImageError naming row and image); waits for it."""
        self.prefetch(key, prompt, row_id, ctx)
        future = self._pending.pop(key, None)
        return prompt if future is None else future.result()

    def clear(self) -> None:
        """Drop every prefetched prompt (their shards ended without them)."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()

    def close(self) -> None:
        """Stop the pool (pending fetches are cancelled)."""
        self.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
