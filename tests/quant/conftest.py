"""A tiny Llama-shaped stack of plain ``nn.Linear`` layers (names as in jobrunner.models.llama)."""

from __future__ import annotations

import pytest
import torch
from torch import nn


class TinyBlock(nn.Module):
    def __init__(self, hidden: int, inter: int, qkv_bias: bool) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(hidden, 3 * hidden, bias=qkv_bias)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        x = x + self.o_proj(torch.tanh(q * k) * v)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return x + self.down_proj(nn.functional.silu(gate) * up)


class TinyLlama(nn.Module):
    """Embedding, two blocks, lm_head tied (or not) to the embedding."""

    def __init__(self, vocab: int = 96, hidden: int = 64, inter: int = 128, tied: bool = True,
                 qkv_bias: bool = True) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(TinyBlock(hidden, inter, qkv_bias) for _ in range(2))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


@pytest.fixture
def tiny_llama() -> TinyLlama:
    torch.manual_seed(0)
    model = TinyLlama()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    return model.eval()
