"""The large-batch path of every quantized layer: dequantize tile by tile into one reused buffer, then GEMM.

A tile is a run of output rows ``[n0, n1)``; its dequantized weight goes into a slice of a :class:`DequantBuffer`
(allocated once per model, dtype and device, never per call: a fresh multi-MB tensor per layer and step costs
page faults on CPU and allocator churn on CUDA) and is multiplied at once, so on CPU it is still in cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class DequantBuffer:
    """One flat scratch tensor per (device, dtype), shared by the quantized layers of one model.

    The layers of a model run one after another, so they can share it; two models (engines) get two buffers.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self.generation = 0  # counts (re)allocations: a holder of raw pointers rebinds when it moves

    def reserve(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        """Make sure ``numel`` elements are available (call at load time, outside CUDA graph capture)."""
        self.get(numel, dtype, device)

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat view of ``numel`` elements; its contents are garbage until written."""
        key = (str(device), dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # Growing now would free memory a captured graph may still point at: use a one-off tensor.
                return torch.empty(numel, dtype=dtype, device=device)
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
            self.generation += 1
        return buf[:numel]

    def nbytes(self) -> int:
        """Bytes held (reported so that the scratch memory is not hidden)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


# fill(n0, n1, out [n1 - n0, K] view of the buffer) writes W[n0:n1] in out's dtype and returns it.
TileFiller = Callable[[int, int, torch.Tensor], torch.Tensor]


def tiled_linear(x: torch.Tensor, out_features: int, fill: TileFiller, buffer: DequantBuffer,
                 tile_rows: int) -> torch.Tensor:
    """``x [M, K] @ W.T`` in ``x.dtype``, with ``W`` produced ``tile_rows`` output rows at a time by ``fill``."""
    m, k = x.shape
    if tile_rows >= out_features:
        w = fill(0, out_features, buffer.get(out_features * k, x.dtype, x.device).view(out_features, k))
        return torch.nn.functional.linear(x, w)
    y = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    scratch = buffer.get(tile_rows * k, x.dtype, x.device)
    for n0 in range(0, out_features, tile_rows):
        n1 = min(out_features, n0 + tile_rows)
        w = fill(n0, n1, scratch[: (n1 - n0) * k].view(n1 - n0, k))
        torch.mm(x, w.t(), out=y[:, n0:n1])
    return y


def tile_rows_for(out_features: int, in_features: int, tile_weights: int, multiple: int = 1) -> int:
    """Rows per tile: about ``tile_weights`` weights, a multiple of ``multiple`` (the packed layout's block)."""
    rows = max(multiple, tile_weights // max(in_features, 1) // multiple * multiple)
    return min(rows, out_features)
