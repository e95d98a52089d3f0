"""The SigLIP vision transformer as Idefics3 / SmolVLM use it: patch embedding, learned positions, pre-norm
encoder layers with bidirectional attention, a final LayerNorm.

Idefics3's variant takes images of variable size padded into a fixed tile (``patch_mask`` marks the real
patches): a padded image's patches take the positions of a full grid stretched over its real extent (the
fractional row / column of each patch, bucketed into the learned grid), and attention never looks at padding.
Parameter names follow the Hugging Face checkpoints (``embeddings.patch_embedding``, ``encoder.layers.N.
self_attn.q_proj``, ``post_layernorm``), so a checkpoint's tensors load under their own names.

Every linear is a :class:`VisionLinear`: a plain ``nn.Linear`` that the CPU weight packers and quantizers, which
take only modules of type ``nn.Linear``, leave alone (they are sized for the decoder's flat token batches).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VisionLinear(nn.Linear):
    """A linear of the vision tower (see the module docstring)."""


def _activation(name: str):
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"vision_config.hidden_act {name!r} is not supported (gelu_pytorch_tanh, gelu)")


class VisionEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.num_patches_per_side = config.image_size // config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=config.patch_size,
                                         stride=config.patch_size, padding="valid")
        self.position_embedding = nn.Embedding(self.num_patches_per_side ** 2, config.hidden_size)

    def forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        # pixels: [N, C, H, W]; patch_mask: [N, H / patch, W / patch] bool -> [N, patches, hidden]
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        return x + self.position_embedding(self.position_ids(patch_mask))

    def position_ids(self, patch_mask: torch.Tensor) -> torch.Tensor:
        """Each patch's row of the learned grid: its fractional (row, column) in the image's real extent, bucketed
        into ``num_patches_per_side`` steps (the identity for an image that fills the tile); padding: 0."""
        side = self.num_patches_per_side
        n, rows, cols = patch_mask.shape
        device = patch_mask.device
        boundaries = torch.arange(1 / side, 1.0, 1 / side, device=device)
        real_rows = patch_mask[:, :, 0].sum(dim=1)  # [N]
        real_cols = patch_mask[:, 0, :].sum(dim=1)
        frac_h = torch.arange(rows, device=device, dtype=torch.float32)[None, :] * (1.0 / real_rows)[:, None]
        frac_w = torch.arange(cols, device=device, dtype=torch.float32)[None, :] * (1.0 / real_cols)[:, None]
        bucket_h = torch.bucketize(frac_h.clamp(max=1.0 - 1e-6), boundaries, right=True)
        bucket_w = torch.bucketize(frac_w.clamp(max=1.0 - 1e-6), boundaries, right=True)
        ids = (bucket_h[:, :, None] * side + bucket_w[:, None, :]).reshape(n, -1)
        return torch.where(patch_mask.reshape(n, -1), ids, torch.zeros_like(ids))


class VisionAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        if self.head_dim * self.num_heads != hidden:
            raise ValueError(f"vision_config: hidden_size {hidden} is not a multiple of num_attention_heads "
                             f"{self.num_heads}")
        self.q_proj = VisionLinear(hidden, hidden)
        self.k_proj = VisionLinear(hidden, hidden)
        self.v_proj = VisionLinear(hidden, hidden)
        self.out_proj = VisionLinear(hidden, hidden)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        # x: [N, L, hidden]; key_mask: [N, 1, 1, L] bool (True: a real patch) or None (all real)
        n, length, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, length, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
                                             attn_mask=key_mask, scale=self.head_dim ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(n, length, -1))


class VisionMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.act = _activation(config.hidden_act)
        self.fc1 = VisionLinear(config.hidden_size, config.intermediate_size)
        self.fc2 = VisionLinear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), key_mask)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(config) for _ in range(config.num_hidden_layers))


class SiglipVisionTransformer(nn.Module):
    """Tiles ``[N, C, H, W]`` (+ their pixel mask) -> patch features ``[N, patches, vision hidden]``."""

    def __init__(self, config) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.embeddings = VisionEmbeddings(config)
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor, pixel_mask: torch.Tensor | None = None) -> torch.Tensor:
        patch_mask = self.patch_mask(pixels, pixel_mask)
        x = self.embeddings(pixels, patch_mask)
        key_mask = None if bool(patch_mask.all()) else patch_mask.reshape(len(x), 1, 1, -1)
        for layer in self.encoder.layers:
            x = layer(x, key_mask)
        return self.post_layernorm(x)

    def patch_mask(self, pixels: torch.Tensor, pixel_mask: torch.Tensor | None) -> torch.Tensor:
        """``[N, H / patch, W / patch]`` bool: patches holding at least one real pixel (all, without a mask)."""
        p = self.patch_size
        n, _, height, width = pixels.shape
        if pixel_mask is None:
            return torch.ones(n, height // p, width // p, dtype=torch.bool, device=pixels.device)
        grid = pixel_mask.unfold(1, p, p).unfold(2, p, p)  # [N, H/p, W/p, p, p]
        return grid.sum(dim=(-1, -2)) > 0
