"""Rotary position embeddings as the model config says (default, linear, llama3 or yarn scaling).

Our cos/sin tables are fixed per position, so we accept exactly the scalings whose frequencies do not depend on
the running sequence length. ``dynamic`` (NTK) and ``longrope`` recompute their frequencies in transformers from
the longest position of each forward pass (and ``proportional`` is Gemma's partial rotary): they are refused
with an error naming the type, rather than silently computed differently.
"""

from __future__ import annotations

import torch


def rope_parameters(config) -> dict:
    """The config's rope settings in one shape, for transformers 4.x (rope_scaling) and 5.x (rope_parameters)."""
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def inv_freq_and_scaling(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the cos/sin scaling factor, computed as transformers does."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling rope_type={rope_type!r}; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)} (dynamic and longrope change with the sequence length, "
                         "which fixed per-position tables cannot follow)")
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    with torch.device("cpu"):  # also when the model itself is being built on "meta"
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.inv_freq, self.scaling = inv_freq_and_scaling(config, head_dim)
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build_tables(torch.device("cpu"))

    def build_tables(self, device: torch.device) -> None:
        """(Re)compute the tables on ``device`` in float32 (also after the model was built on "meta")."""
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = positions[:, None] * self.inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.cos = emb.cos() * self.scaling
        self.sin = emb.sin() * self.scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, head_dim]`` of ``positions`` in ``dtype``: looked up once per step for all layers."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [T, num_heads, head_dim], k: [T, num_kv_heads, head_dim]; cos, sin: [T, 1, head_dim]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
