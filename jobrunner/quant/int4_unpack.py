"""Read back the CPU int4 kernel's packed weight: whole (dequantize-then-GEMM path) or a few rows (embedding).

``_convert_weight_to_int4pack_for_cpu`` stores N in blocks of ``block_n`` rows (64 with AVX512, 32 otherwise),
each block as [K, block_n / 2] bytes. Vectorized builds put rows ``[0, block_n/2)`` in the low nibbles and the
rest in the high nibbles ("split"); a partial last block, and scalar builds, interleave rows (row 2j low,
2j+1 high). This layout is torch's internal business, so :func:`find_cpu_layout` tries the known layouts
on the actual weight and only returns one that reproduces it exactly; otherwise the layer keeps the packed
kernel for every call (and a tied embedding gets its own int8 table).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_CANDIDATES = ((64, True), (32, True), (32, False))


@dataclass(frozen=True)
class CpuInt4Layout:
    """Where each (row, k) nibble of a CPU-packed int4 weight [out_features, in_features] lives."""

    out_features: int
    in_features: int
    block_n: int
    is_split: bool

    @property
    def _num_full(self) -> int:
        return self.out_features // self.block_n

    @property
    def num_full_rows(self) -> int:
        """Rows in whole blocks (a partial last block is stored interleaved)."""
        return self._num_full * self.block_n

    @property
    def _cut(self) -> int:
        return self._num_full * self.in_features * self.block_n // 2

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """All values, as uint8 [out_features, in_features] in 0..15 (whole blocks at a time)."""
        flat, k = packed.reshape(-1), self.in_features
        parts = []
        if self._num_full:
            full = flat[: self._cut].view(self._num_full, k, self.block_n // 2)
            full = _split(full) if self.is_split else _interleave(full)  # [blocks, K, block_n]
            parts.append(full.transpose(1, 2).reshape(self._num_full * self.block_n, k))
        tail_n = self.out_features - self._num_full * self.block_n
        if tail_n:
            parts.append(_interleave(flat[self._cut:].view(k, tail_n // 2)).t())
        return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()

    def unpack_rows_t(self, packed: torch.Tensor, n0: int, n1: int, out: torch.Tensor) -> None:
        """Write the codes of rows ``[n0, n1)`` transposed into ``out`` [K, n1 - n0] (any dtype).

        ``n0`` must start a block. Whole blocks are two strided copies (low and high nibbles) straight into
        ``out``, with the conversion to ``out.dtype`` in the same pass; rows of a partial last block are
        gathered.
        """
        k, half = self.in_features, self.block_n // 2
        full_end = self._num_full * self.block_n
        f1 = min(n1, full_end)
        if f1 > n0:
            b0, b1 = n0 // self.block_n, f1 // self.block_n
            src = packed.reshape(-1)[b0 * k * half: b1 * k * half].view(b1 - b0, k, half).transpose(0, 1)
            if self.is_split:
                dst = out[:, : f1 - n0].unflatten(1, (b1 - b0, self.block_n))
                dst[..., :half].copy_(src & 15)
                dst[..., half:].copy_(src >> 4)
            else:
                dst = out[:, : f1 - n0].unflatten(1, (b1 - b0, half, 2))
                dst[..., 0].copy_(src & 15)
                dst[..., 1].copy_(src >> 4)
        if n1 > max(n0, f1):
            start = max(n0, f1)
            rows = torch.arange(start, n1, device=packed.device)
            out[:, start - n0:].copy_(self.gather_rows(packed, rows).t())

    def gather_rows(self, packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Values of output rows ``rows`` [T] as uint8 [T, in_features] (one gather of T * K bytes)."""
        half = self.block_n // 2
        tail_half = (self.out_features - self._num_full * self.block_n) // 2
        block, j = rows // self.block_n, rows % self.block_n
        in_full = block < self._num_full
        if self.is_split:
            col, high = j % half, j >= half
        else:
            col, high = j // 2, j % 2 == 1
        # byte of (row, k) = base + k * stride: [K, half] per full block, [K, tail_half] for the tail
        base = torch.where(in_full, block * self.in_features * half + col, self._cut + j // 2)
        stride = torch.where(in_full, half, max(tail_half, 1))
        high = torch.where(in_full, high, j % 2 == 1)
        k = torch.arange(self.in_features, device=rows.device)
        byte_rows = packed.reshape(-1)[base[:, None] + k[None, :] * stride[:, None]]
        return _nibble(byte_rows, high)


def _split(block: torch.Tensor) -> torch.Tensor:
    # [..., block_n / 2] bytes -> [..., block_n]: low nibbles are the first half of the rows
    return torch.cat([block & 15, block >> 4], dim=-1)


def _interleave(block: torch.Tensor) -> torch.Tensor:
    # [..., n / 2] bytes -> [..., n]: row 2j in the low nibble, 2j + 1 in the high one
    return torch.stack([block & 15, block >> 4], dim=-1).flatten(-2)


def _nibble(byte_rows: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    # byte_rows: [T, K] uint8; high: [T] bool -> the high or low nibble of each row
    return torch.where(high[:, None], byte_rows >> 4, byte_rows & 15)


def find_cpu_layout(packed: torch.Tensor, q: torch.Tensor) -> CpuInt4Layout | None:
    """The layout that reproduces ``q`` [N, K] (values 0..15) from ``packed`` exactly, or ``None``."""
    out_features, in_features = q.shape
    for block_n, is_split in _CANDIDATES:
        layout = CpuInt4Layout(out_features, in_features, block_n, is_split)
        try:
            if _reproduces(layout, packed, q):
                return layout
        except RuntimeError:  # sizes that don't fit this layout
            continue
    return None


def _reproduces(layout: CpuInt4Layout, packed: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether ``layout`` reads ``q`` back from ``packed``, compared by blocks of rows (a bounded buffer, not a
    copy of the whole weight: a quantized streamed load's peak stays near its layer)."""
    step = max(64, (1 << 20) // max(layout.in_features, 1) // 64 * 64)
    out = torch.empty(layout.in_features, min(step, layout.out_features), dtype=torch.uint8, device=q.device)
    for n0 in range(0, layout.out_features, step):
        n1 = min(n0 + step, layout.out_features)
        part = out[:, : n1 - n0]
        layout.unpack_rows_t(packed, n0, n1, part)
        if not torch.equal(part, q[n0:n1].t().to(torch.uint8)):
            return False
    return True
