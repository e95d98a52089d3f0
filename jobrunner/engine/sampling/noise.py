"""Counter-based random numbers: the noise for (seed, output position, vocab index) is a pure hash.

No generator state, no per-row launches: one vectorised hash over ``[rows, candidates]`` gives every row its
own stream, so a row's sample depends only on its seed, its position and its logits — never on what else
is in the batch, on preemption and recompute, or on which candidates another row kept. Gumbel-max over the
hashed uniforms draws exactly from softmax(logits) (the exponential-race trick in log space).
"""

from __future__ import annotations

import torch

from jobrunner.engine.sampling import to_device

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


def _signed32(value: int) -> int:
    """A 32-bit pattern as the int32 value with the same bits."""
    return value - (1 << 32) if value >= 1 << 31 else value


_C1, _C2, _GOLDEN = _signed32(0x7FEB_352D), _signed32(0x846C_A68B), _signed32(GOLDEN32)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # lowbias32 (C. Wellons) on int32 tensors: products wrap mod 2**32 (what we want), and each right shift is
    # masked to its width because int32 shifts are arithmetic
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _C1
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _C2
    return x ^ ((x >> 16) & 0xFFFF)


def gumbel(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel noise ``[rows, k]`` for ``token_ids`` ``[rows, k]`` (or ``[1, k]``) under per-row ``keys`` ``[rows]``.

    32-bit integer work (half the memory of int64 on a ``[rows, vocab]`` draw); the same numbers as
    :func:`uniform_reference`.
    """
    lo = _as_int32(keys & M32)[:, None]
    hi = _as_int32((keys >> 32) & M32)[:, None]
    x = _mix32(token_ids.int() * _GOLDEN + lo)
    x = _mix32(x ^ hi)
    return -torch.log(-torch.log(uniform_from_bits(x)))


def uniform_from_bits(x: torch.Tensor) -> torch.Tensor:
    """int32 hash bits -> float32 uniforms in (0, 1), never 0 or 1.

    23 bits, not 24: float32 spaces its values 2**-24 apart just below 1, so (2**24 - 0.5) / 2**24 would round
    to exactly 1.0, and its Gumbel noise to +inf (then inf + -inf = NaN wins the argmax: a filtered or
    grammar-masked token would be drawn). The largest value here, 1 - 2**-24, is exact.
    """
    return (((x >> 9) & 0x7F_FFFF).float() + 0.5) * (1.0 / (1 << 23))


def _as_int32(values: torch.Tensor) -> torch.Tensor:
    # int64 in [0, 2**32) -> int32 with the same low 32 bits
    return torch.where(values >= 1 << 31, values - (1 << 32), values).int()


def uniform_reference(key: int, token_id: int) -> float:
    """The uniform behind :func:`gumbel` for one (row key, token id), in plain Python (tests, docs)."""
    def mix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB_352D) & M32
        x ^= x >> 15
        x = (x * 0x846C_A68B) & M32
        return x ^ (x >> 16)

    x = mix(mix((token_id * GOLDEN32 + (key & M32)) & M32) ^ ((key >> 32) & M32))
    return ((x >> 9) + 0.5) / (1 << 23)


def keys_tensor(keys: list[int], device: torch.device) -> torch.Tensor:
    """Row keys as an int64 tensor (the top bit is dropped: int64 is signed)."""
    return to_device([k >> 1 for k in keys], device, torch.int64)
