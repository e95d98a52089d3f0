"""SmolVLM / Idefics3: a SigLIP vision encoder, a pixel-shuffle connector and our Llama decoder.

An image is cut by transformers' own processor into square tiles (up to rows x cols tiles of the resized image,
plus the whole image shrunk to one tile); each tile becomes ``image_seq_len`` ``<image>`` tokens of the prompt
(the processor writes them, with the ``<fake_token_around_image>`` / ``<row_r_col_c>`` / ``<global-img>`` text
around them). The model encodes each tile (:class:`SiglipVisionTransformer`), folds every ``scale_factor x
scale_factor`` block of patch features into one (pixel shuffle: ``patches / scale^2`` vectors
``scale^2`` times wider) and projects them to the decoder's width; those vectors replace the embeddings of the
``<image>`` tokens, in order. Everything after that is the text decoder as it runs for text-only prompts.

The engine hands the replacement rows of a step to :meth:`Idefics3ForConditionalGeneration.image_step` around the
forward (engine/vision.py decides which rows of which image a prompt chunk holds).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import replace

import torch
from torch import nn

from jobrunner.models.llama import LlamaForCausalLM
from jobrunner.models.vision.siglip import SiglipVisionTransformer, VisionLinear

VISION_ARCHITECTURES = ("Idefics3ForConditionalGeneration",)


class ModalityProjection(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = VisionLinear(in_features, out_features, bias=False)


class Idefics3Connector(nn.Module):
    """Pixel shuffle then a linear projection: ``[tiles, patches, vision hidden]`` -> ``[tiles, patches / s^2,
    text hidden]``."""

    def __init__(self, config) -> None:
        super().__init__()
        self.scale_factor = config.scale_factor
        width = config.vision_config.hidden_size * config.scale_factor ** 2
        self.modality_projection = ModalityProjection(width, config.text_config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(pixel_shuffle(x, self.scale_factor))


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """Fold each ``scale x scale`` block of a square patch grid into one vector: ``[N, side * side, D]`` ->
    ``[N, (side / scale)^2, D * scale^2]`` (the layout SmolVLM was trained on: columns folded first, then rows)."""
    n, seq, dim = x.shape
    side = int(seq ** 0.5)
    if side * side != seq or side % scale:
        raise ValueError(f"pixel shuffle needs a square grid divisible by {scale}, got {seq} patches")
    x = x.view(n, side, side // scale, dim * scale)          # fold columns
    x = x.permute(0, 2, 1, 3).reshape(n, side // scale, side // scale, dim * scale * scale)  # fold rows
    return x.permute(0, 2, 1, 3).reshape(n, seq // scale ** 2, dim * scale ** 2)


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    """Our Llama decoder (built from ``config.text_config``) plus ``vision_model`` and ``connector``.

    ``encode_images`` turns tiles into the decoder-width vectors of their ``<image>`` tokens; ``image_step``
    (a context manager around one forward) puts given vectors at given rows of the step's token embeddings.
    Tensor parallel is refused (the vision tower is not split).
    """

    is_vision_language = True

    def __init__(self, config, max_positions: int | None = None, tensor_parallel=None) -> None:
        if tensor_parallel is not None and getattr(tensor_parallel, "is_parallel", False):
            raise ValueError(f"{config.architectures[0]}: tensor parallel is not supported for vision-language "
                             "models yet (run it with tensor_parallel_size 1)")
        text_config = copy.deepcopy(config.text_config)
        text_config.architectures = ["LlamaForCausalLM"]
        # the composite model's own flag ties lm_head to the decoder's embeddings (as transformers reads it)
        text_config.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if getattr(text_config, "model_type", "llama") not in ("llama",):
            raise ValueError(f"{config.architectures[0]}: text_config.model_type {text_config.model_type!r} is not "
                             "supported (a Llama decoder, as SmolVLM's)")
        super().__init__(text_config, max_positions, None)
        self.shape = replace(self.shape, architecture=config.architectures[0])
        self.image_token_id = int(config.image_token_id)
        vision = config.vision_config
        self.image_seq_len = (vision.image_size // vision.patch_size) ** 2 // config.scale_factor ** 2
        self.vision_model = SiglipVisionTransformer(vision)
        self.connector = Idefics3Connector(config)
        self._step_images: tuple[torch.Tensor, torch.Tensor] | None = None
        self.processor = None  # transformers' processor, set by the loader (engine/vision.py uses it)

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor, pixel_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Tiles ``[N, C, H, W]`` (+ pixel mask ``[N, H, W]``) -> ``[N * image_seq_len, text hidden]``."""
        dtype = self.vision_model.post_layernorm.weight.dtype
        device = self.vision_model.post_layernorm.weight.device
        pixels = pixels.to(device=device, dtype=dtype)
        mask = None if pixel_mask is None else pixel_mask.to(device=device, dtype=torch.bool)
        features = self.connector(self.vision_model(pixels, mask))
        return features.reshape(-1, features.shape[-1]).to(self.dtype)

    @contextlib.contextmanager
    def image_step(self, rows: torch.Tensor | None, vectors: torch.Tensor | None):
        """Within the block, the forward's token embeddings at flat ``rows`` are ``vectors`` (``[rows, hidden]``)."""
        self._step_images = None if rows is None else (rows, vectors)
        try:
            yield
        finally:
            self._step_images = None

    def embed_inputs(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed_inputs(input_ids)
        if self._step_images is not None:
            rows, vectors = self._step_images
            x = x.index_copy(0, rows, vectors.to(x.dtype))
        return x

    @staticmethod
    def vision_target(name: str) -> tuple[tuple[str, None] | None, str]:
        """A checkpoint tensor of the vision tower or the connector: ``((our name, None), name)``; a text decoder
        tensor: ``(None, its name in a Llama checkpoint's layout)`` (``model.text_model.`` -> ``model.``)."""
        for prefix in ("model.vision_model.", "model.connector."):
            if name.startswith(prefix):
                return (name[len("model."):], None), name
        if name.startswith("model.text_model."):
            return None, "model." + name[len("model.text_model."):]
        return None, name
