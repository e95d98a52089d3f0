"""Transparent huge pages for the large, long-lived CPU tensors a decode step streams: the KV cache and the
AMX-packed weights.

A decode step reads its rows' keys and values block by block, scattered over the cache, and every packed weight
once; with 4 KB pages that is a TLB miss every few cache lines. Linux backs memory with 2 MB pages where the
process asks for them (``madvise(MADV_HUGEPAGE)``, what ``transparent_hugepage=madvise``, the usual default,
waits for). :func:`advise_huge_pages` asks for a tensor's 2 MB-aligned interior; it must run before the
memory is first written (already-backed pages stay small until the kernel's background collapse, if ever).

Measured on the 2-core AMX Xeon (2026-12-05, ShareGPT 64 x 64, bf16, alternated): torch's
``THP_MEM_ALLOC_ENABLE=1`` (every allocation of 2 MB and more) gave 1,034 / 1,026 vs 991 / 1,002 out tok/s, decode
attention 13.6-13.8 vs 14.9 ms/step and decode GEMMs 18.4-18.6 vs 19.8-21.0, but slower prompt steps (their
short-lived activations fault whole huge pages in every step); so only these two kinds of tensors ask. With
that (the long few-shot set, 72 rows x ~1.25 k keys, ``--profile``, alternated): decode-step attention 35.1 /
35.4 vs 38.2 / 40.1 ms, decode GEMMs 20.3 / 20.1 vs 23.7 / 22.6 ms (``JOBRUNNER_HUGE_PAGES=1`` vs ``0``).

Off where it cannot apply (not Linux, not a CPU tensor, under 2 MB) or with ``JOBRUNNER_HUGE_PAGES=0``. A kernel
set to ``never`` ignores the advice; nothing else changes.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

import torch

HUGE_PAGES_ENV = "JOBRUNNER_HUGE_PAGES"
HUGE = 2 << 20
MADV_HUGEPAGE = 14


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask for huge pages under ``tensor``'s storage (its whole 2 MB pages); True where the kernel took the
    advice. Call it before writing the tensor."""
    if os.environ.get(HUGE_PAGES_ENV, "1").strip() == "0" or tensor.device.type != "cpu":
        return False
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    first, last = -(-start // HUGE) * HUGE, end // HUGE * HUGE
    madvise = _madvise()
    if madvise is None or last - first < HUGE:
        return False
    return madvise(first, last - first, MADV_HUGEPAGE) == 0


def empty_huge(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype)`` on CPU with huge pages asked for (:func:`advise_huge_pages`), unwritten."""
    tensor = torch.empty(*shape, dtype=dtype)
    advise_huge_pages(tensor)
    return tensor
