"""Images in a request: from chat parts to ``<image>`` tokens and pixels, and from pixels to the step's rows.

**At add_request** (:func:`image_prompt`): the prompt's images (``engine/images.py``: ``ImageInput`` parts) go
through transformers' own processor of the model: its chat template renders the messages with an image marker
per image part, and the processor resizes and splits each image into tiles and expands each marker into the
image's tokens, so the token layout is exactly transformers'. Each image keeps its decoded picture, its tile
count, its digest and the prompt positions of its ``<image>`` tokens (:class:`PromptImage`); its tiles are not
kept (float tiles of a large picture weigh tens of MB, and a worker holds up to twice max_num_seqs requests):
the image processor makes them again, alone for that image (the same tensors as in the prompt's call), when the
image is encoded.

**Per step** (:class:`ImageEncoder`, owned by the model runner): for every scheduled row whose new tokens
include image tokens, the image is encoded once (vision tower + connector; the tiles of all the step's new
images in one call) and its
vectors are kept on the request until the step that computes its last image token; a prompt chunk takes the
slice of vectors its positions cover (chunked prefill), and the vectors replace those rows' token embeddings
in the forward (``model.image_step``). A preempted request drops its vectors (its picture stays): if its KV is
recomputed the image is encoded again, unless a prefix-cache hit covers the image tokens, then never.

**Prefix caching**: a KV block that holds image tokens is keyed by its tokens *and* the digest of each image
it covers (:meth:`RequestImages.block_markers`, read by ``kv_cache/manager.py``): the same image under the same
prompt is a hit, a different image with the same text (identical ``<image>`` ids) is not.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from jobrunner.engine.images import ImageInput, prompt_images


@dataclass
class PromptImage:
    """One image of a request: the picture, its tile count, and where its ``<image>`` tokens are in the prompt."""

    image: ImageInput = field(repr=False)
    num_tiles: int
    positions: list[int] = field(repr=False)             # prompt positions of its <image> tokens, ascending
    vectors: torch.Tensor | None = field(default=None, repr=False)  # [len(positions), hidden] until prefilled

    @property
    def digest(self) -> str:
        return self.image.digest

    @property
    def first(self) -> int:
        return self.positions[0]

    @property
    def last(self) -> int:
        return self.positions[-1]


@dataclass
class RequestImages:
    """The images of one request (shared by its n samples)."""

    images: list[PromptImage]

    @property
    def num_images(self) -> int:
        return len(self.images)

    @property
    def num_image_tokens(self) -> int:
        return sum(len(image.positions) for image in self.images)

    def block_markers(self, start: int, end: int) -> tuple[str, ...]:
        """``image:<digest>`` of every image with a token in positions ``[start, end)`` (a KV block's key)."""
        return tuple(f"image:{image.digest}" for image in self.images if image.first < end and image.last >= start)

    def drop_vectors(self) -> None:
        for image in self.images:
            image.vectors = None


def is_chat_prompt(prompt: Any) -> bool:
    """Whether ``prompt`` is a list of chat messages (not text, not token ids)."""
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and bool(prompt) and \
        isinstance(prompt[0], dict)


def image_prompt(model: Any, messages: Sequence[dict[str, Any]], chat_template: str | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], RequestImages | None]:
    """Token ids (image tokens expanded) and images (None without any) of a chat prompt, through
    ``model.processor`` (its chat template: a vision-language model's tokenizer may have none of its own).

    Raises ``ValueError`` when the processor's tiles and tokens do not match the model's image size."""
    processor = model.processor
    images = prompt_images(messages)
    text = processor.apply_chat_template(_template_messages(messages), tokenize=False, add_generation_prompt=True,
                                         chat_template=chat_template, **(chat_template_kwargs or {}))
    if not images:
        return processor(text=[text], return_tensors="pt")["input_ids"][0].tolist(), None
    encoded = processor(text=[text], images=[[image.pixels for image in images]], return_tensors="pt")
    token_ids = encoded["input_ids"][0].tolist()
    num_tiles = len(encoded["pixel_values"][0])
    del encoded  # the tiles are made again when the image is encoded (see the module docstring)
    tiles = [_num_tiles(processor, image) for image in images]
    positions = [i for i, t in enumerate(token_ids) if t == model.image_token_id]
    if sum(tiles) != num_tiles or len(positions) != sum(tiles) * model.image_seq_len:
        raise ValueError(f"the image processor made {num_tiles} tiles and {len(positions)} image tokens for "
                         f"{len(images)} image(s) ({model.image_seq_len} tokens per tile expected): its config "
                         "does not match the model's")
    out, token = [], 0
    for image, n in zip(images, tiles):
        num_tokens = n * model.image_seq_len
        out.append(PromptImage(image, n, positions[token:token + num_tokens]))
        token += num_tokens
    return token_ids, RequestImages(out)


def _template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as a processor's chat template reads them: an image part is ``{"type": "image"}``."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [{"type": "image"} if isinstance(p, dict) and p.get("type") == "image" else p for p in content]
        out.append({**message, "content": content})
    return out


def _num_tiles(processor: Any, image: ImageInput) -> int:
    """How many tiles the processor cuts ``image`` into (its grid plus the global one; 1 when not split)."""
    width, height = image.size
    num_patches, _, _ = processor.image_processor.get_number_of_image_patches(height, width, {})
    return max(int(num_patches), 1)


MAX_TILES_PER_CALL = 64  # whole images per encoder call up to this many tiles (bounds its activations)


def _batches(group: list) -> list[list]:
    """``(image, tiles, mask)`` entries cut into runs of whole images of at most MAX_TILES_PER_CALL tiles (an
    image with more is a run of its own)."""
    batches: list[list] = [[]]
    count = 0
    for entry in group:
        if batches[-1] and count + len(entry[1]) > MAX_TILES_PER_CALL:
            batches.append([])
            count = 0
        batches[-1].append(entry)
        count += len(entry[1])
    return batches


class ImageEncoder:
    """Runs the model's vision encoder for the image tokens of a step (see the module docstring).

    Counters: ``seconds`` making tiles and encoding them, ``num_images`` encoded (an image encoded twice, after a
    preemption, counts twice), ``num_tiles``; ``stats`` (an ``EngineStats``, set by the engine) gets the same."""

    def __init__(self, model: Any, stats: Any = None) -> None:
        self.model = model
        self.seconds = 0.0
        self.num_images = 0
        self.num_tiles = 0
        self.stats = stats

    def step_rows(self, scheduled: Sequence[Any], query_starts: Sequence[int], device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The flat rows of this step that hold image tokens and their vectors ``[rows, hidden]``, or None. The
        step's images without vectors are encoded first, together (:meth:`encode`)."""
        found = []  # (flat offset of the row, its first new position, its end, the image)
        for s, offset in zip(scheduled, query_starts):
            images = s.request.images
            if images is None:
                continue
            start, end = s.start, s.start + s.num_new_tokens
            found += [(offset, start, end, image) for image in images.images
                      if image.first < end and image.last >= start]
        if not found:
            return None
        missing = {id(image): image for *_, image in found if image.vectors is None}
        if missing:
            self.encode(list(missing.values()))
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        for offset, start, end, image in found:
            a, b = bisect.bisect_left(image.positions, start), bisect.bisect_left(image.positions, end)
            rows += [offset + p - start for p in image.positions[a:b]]
            parts.append(image.vectors[a:b])
        for *_, end, image in found:
            if image.last < end:  # prefilled with this step: let its vectors go
                image.vectors = None
        return torch.tensor(rows, dtype=torch.long, device=device), torch.cat(parts)

    def encode(self, images: list[PromptImage]) -> None:
        """Set each image's vectors: its tiles made by the image processor, the tiles of all of them encoded in
        one call (per tile size, should sizes differ; MAX_TILES_PER_CALL at most); timed and counted."""
        t0 = time.perf_counter()
        by_size: dict[tuple[int, ...], list[tuple[PromptImage, torch.Tensor, torch.Tensor | None]]] = {}
        for image in images:
            tiles = self.model.processor.image_processor(images=[[image.image.pixels]], return_tensors="pt")
            pixels, mask = tiles["pixel_values"][0], tiles.get("pixel_attention_mask")
            if len(pixels) != image.num_tiles:
                raise RuntimeError(f"image {image.image.source}: {len(pixels)} tiles now, {image.num_tiles} in its "
                                   "prompt")
            by_size.setdefault(tuple(pixels.shape[1:]), []).append((image, pixels, None if mask is None else mask[0]))
        for group in by_size.values():
            for batch in _batches(group):
                masks = [m for _, _, m in batch]
                mask = None if any(m is None for m in masks) else torch.cat(masks)
                vectors = self.model.encode_images(torch.cat([p for _, p, _ in batch]), mask)
                for (image, _, _), part in zip(batch, vectors.split([len(im.positions) for im, _, _ in batch])):
                    image.vectors = part
        seconds = time.perf_counter() - t0
        self.seconds += seconds
        self.num_images += len(images)
        self.num_tiles += sum(image.num_tiles for image in images)
        if self.stats is not None:
            self.stats.vision_encoder_s += seconds
            self.stats.num_images_encoded += len(images)

    @staticmethod
    def drop(requests: Sequence[Any]) -> None:
        """Preempted requests let their images' vectors go (encoded again if their KV is recomputed)."""
        for request in requests:
            if request.images is not None:
                request.images.drop_vectors()
