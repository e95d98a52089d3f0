"""Rotary position embeddings as the model config says (default, linear, llama3, yarn or longrope scaling).

Our cos/sin tables are fixed per position. Most scalings have one set of frequencies whatever the sequence
length. ``longrope`` (Phi-3 / Phi-3.5, ``"su"`` in older configs) has two: transformers rotates every position of
a forward pass with its *short* factors while the sequence is at most ``original_max_position_embeddings`` long
and with its *long* factors past that (both times the same attention factor on cos/sin), and its ``generate``
drops the KV cache and recomputes the whole sequence at the token that crosses the threshold, so a sequence's
keys always carry the table its current length picks. We keep both tables (``long_threshold`` says where they
switch; rows ``[max_positions, 2 * max_positions)`` hold the long one, see :meth:`RotaryEmbedding.table_offset`)
and the engine does what transformers does (``jobrunner.engine.long_rope``). When the engine never sees a sequence
past the threshold only the short table is built. ``dynamic`` (NTK) is refused: its frequencies change at every
length past the original context (no fixed set of tables, and no recompute point, follows that), and so is
``proportional`` (Gemma's partial rotary), each with an error naming the type.
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
    if getattr(config, "model_type", None) == "phi3" and params["rope_type"] in ("su", "yarn"):
        params["rope_type"] = "longrope"  # older Phi-3 configs' names for it (transformers' Phi3Config renames them)
    return params


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_REFUSED_WHY = {
    "dynamic": "dynamic NTK changes its frequencies at every length past the original context, which fixed "
               "per-position tables cannot follow",
    "proportional": "proportional (partial) rotary is not implemented",
}


def inv_freq_and_scaling(config, head_dim: int, long: bool = False) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the cos/sin scaling factor, computed as transformers does.

    ``long``: longrope's long-factor frequencies (what transformers uses for a sequence past
    ``original_max_position_embeddings``); the same scaling factor either way.
    """
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        why = _REFUSED_WHY.get(rope_type, "unknown type")
        raise ValueError(f"unsupported rope scaling rope_type={rope_type!r}; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)} ({why})")
    partial = params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
    if float(partial) != 1.0:
        raise ValueError(f"unsupported rope partial_rotary_factor={partial!r}; "
                         "only 1.0 (every head dimension rotated) is implemented")
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    extra = {"seq_len": long_threshold(config) + 1} if long else {}
    with torch.device("cpu"):  # also when the model itself is being built on "meta"
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **extra)
    return inv_freq.float(), float(scaling)


def long_threshold(config) -> int | None:
    """longrope's ``original_max_position_embeddings`` (a longer sequence uses the long factors), else None."""
    params = rope_parameters(config)
    if params["rope_type"] != "longrope":
        return None
    original = params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings",
                                                                          None)
    if not original:
        raise ValueError("longrope rope scaling needs original_max_position_embeddings")
    return int(original)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (plus :meth:`table_offset` for longrope's long table).

    ``long_threshold``: None, or (longrope, when ``max_positions`` reaches past it) the sequence length past which
    a sequence's positions are looked up in the long table: row ``max_positions + position``.
    """

    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.inv_freq, self.scaling = inv_freq_and_scaling(config, head_dim)
        self.max_positions = max_positions
        threshold = long_threshold(config)
        self.long_threshold = threshold if threshold is not None and max_positions > threshold else None
        self.long_inv_freq = inv_freq_and_scaling(config, head_dim, long=True)[0] if self.long_threshold else None
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build_tables(torch.device("cpu"))

    def build_tables(self, device: torch.device) -> None:
        """(Re)compute the tables on ``device`` in float32 (also after the model was built on "meta")."""
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        tables = [self.inv_freq] + ([self.long_inv_freq] if self.long_inv_freq is not None else [])
        freqs = torch.cat([positions[:, None] * inv_freq.to(device)[None, :] for inv_freq in tables])
        emb = torch.cat((freqs, freqs), dim=-1)  # [num_tables * max_positions, head_dim]
        self.cos = emb.cos() * self.scaling
        self.sin = emb.sin() * self.scaling

    def uses_long_table(self, seq_len: int) -> bool:
        """Whether a sequence of ``seq_len`` tokens is rotated with longrope's long factors (as transformers)."""
        return self.long_threshold is not None and seq_len > self.long_threshold

    def table_offset(self, table: int) -> int:
        """What to add to a position to look it up in ``table`` (0: the short / only one; 1: longrope's long one)."""
        return table * self.max_positions

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, head_dim]`` of ``positions`` in ``dtype``: looked up once per step for all layers.

        ``positions`` are table rows: a position, plus :meth:`table_offset` for a sequence on the long table."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [T, num_heads, head_dim], k: [T, num_kv_heads, head_dim]; cos, sin: [T, 1, head_dim]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
