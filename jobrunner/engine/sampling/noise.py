"""Counter-based random numbers: the noise for (seed, output position, vocab index) is a pure hash.

No generator state, no per-row launches: one vectorised hash over ``[rows, candidates]`` gives every row its
own stream, so a row's sample depends only on its seed, its position and its logits — never on what else
is in the batch, on preemption and recompute, or on which candidates another row kept. Gumbel-max over the
hashed uniforms draws exactly from softmax(logits) (the exponential-race trick in log space).
"""

from __future__ import annotations

import torch

M32 = 0xFFFF_FFFF
M64 = 0xFFFF_FFFF_FFFF_FFFF
GOLDEN32 = 0x9E37_79B9


def splitmix64(x: int) -> int:
    """A 64-bit integer mixer (host side, per row)."""
    x = (x + 0x9E37_79B9_7F4A_7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58_476D_1CE4_E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D0_49BB_1331_11EB) & M64
    return x ^ (x >> 31)


def derive_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``seed`` (distinct, reproducible streams)."""
    return splitmix64(splitmix64(seed & M64) ^ index) >> 1


def row_key(seed: int, position: int) -> int:
    """The 64-bit key of one row's noise at one output position."""
    return splitmix64(splitmix64(seed & M64) ^ position)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # lowbias32 (C. Wellons) on int64 tensors holding 32-bit values: shifts stay logical because x >= 0,
    # products may wrap past 2**63 but only their low 32 bits are kept
    x = x ^ (x >> 16)
    x = (x * 0x7FEB_352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846C_A68B) & M32
    return x ^ (x >> 16)


def gumbel(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel noise ``[rows, k]`` for ``token_ids`` ``[rows, k]`` (or ``[k]``) under per-row ``keys`` ``[rows]``."""
    lo = (keys & M32)[:, None]
    hi = ((keys >> 32) & M32)[:, None]
    x = _mix32((token_ids.long() * GOLDEN32 + lo) & M32)
    x = _mix32(x ^ hi)
    uniform = ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1), never 0 or 1
    return -torch.log(-torch.log(uniform))


def keys_tensor(keys: list[int], device: torch.device) -> torch.Tensor:
    """Row keys as an int64 tensor (the top bit is dropped: int64 is signed)."""
    return torch.tensor([k >> 1 for k in keys], dtype=torch.int64, device=device)
