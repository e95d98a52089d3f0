"""Transparent huge pages for the large, long-lived CPU tensors a decode step streams: the packed weights and,
where asked for, the KV cache.

A decode step reads its rows' keys and values block by block, scattered over the cache, and every packed weight
once; with 4 KB pages that is a TLB miss every few cache lines. Linux backs memory with 2 MB pages where the
process asks for them (``madvise(MADV_HUGEPAGE)``, what ``transparent_hugepage=madvise``, the usual default,
waits for). :func:`advise_huge_pages` asks for a tensor's whole 2 MB pages; it must run before the memory is
first written (already-backed pages stay small until the kernel's background collapse, if ever).

``JOBRUNNER_HUGE_PAGES``: ``0`` (the default: none), ``weights`` (the AMX-packed and float32-packed weights),
``all`` (the KV cache too). Opt-in because the kernel may have to compact memory to find free 2 MB pages, which
a job pays at start-up. Measured on the 2-core AMX Xeon (2026-12-05):

* the KV cache too (long few-shot set, 72 rows x ~1.25 k keys, ``--profile``, alternated): decode-step
  attention 35.1 / 35.4 vs 38.2 / 40.1 ms, decode GEMMs 20.3 / 20.1 vs 23.7 / 22.6 ms; but the engine's start
  went 2.9 -> 10.7-12.1 s for SmolLM2's default 2.1 GB cache: the kernel compacts memory to find free 2 MB
  pages when the cache is zeroed (``compact_stall`` in /proc/vmstat), on a VM whose memory the page cache had
  fragmented;
* torch's ``THP_MEM_ALLOC_ENABLE=1`` (every allocation of 2 MB and more): faster decode steps, slower prompt
  steps (their short-lived activations fault whole huge pages in every step);
* the weights alone: each layer's packed weight is its own tensor and only whole 2 MB pages inside one can be
  huge, so on SmolLM2 96 MB of its 330 MB get them (the LM head's 57 MB, the gate|up projections); decode
  GEMMs 19.1 / 19.3 / 18.9 vs 20.1 / 20.2 / 18.9 ms/step (ShareGPT, alternated), the example job's weight
  packing 0.2 -> 0.8 s.

A long job on a node with free memory gains (``all``: ~8% of a long-context decode step); a short one, like the
example job, would start slower than it gains.

Off where it cannot apply (not Linux, not a CPU tensor, under 2 MB). A kernel set to ``never`` ignores the
advice; nothing else changes.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

from jobrunner.kernels import SWITCHES, switch

HUGE_PAGES_ENV = "JOBRUNNER_HUGE_PAGES"
HUGE_PAGES_SETTINGS = SWITCHES[HUGE_PAGES_ENV].choices  # ("0", "weights", "all")
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


def huge_pages_for(kind: str) -> bool:
    """Whether ``kind`` (``"weights"`` or ``"kv_cache"``) asks for huge pages under ``JOBRUNNER_HUGE_PAGES``."""
    value = switch(HUGE_PAGES_ENV)  # ValueError naming the variable unless one of HUGE_PAGES_SETTINGS
    return value == "all" or (value == "weights" and kind == "weights")


def advise_huge_pages(tensor: torch.Tensor, kind: str = "weights") -> bool:
    """Ask for huge pages under ``tensor``'s storage (its whole 2 MB pages) where ``kind`` asks for them
    (:func:`huge_pages_for`); True where the kernel took the advice. Call it before writing the tensor."""
    if not huge_pages_for(kind) or tensor.device.type != "cpu":
        return False
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    first, last = -(-start // HUGE) * HUGE, end // HUGE * HUGE
    madvise = _madvise()
    if madvise is None or last - first < HUGE:
        return False
    return madvise(first, last - first, MADV_HUGEPAGE) == 0


def empty_huge(*shape: int, dtype: torch.dtype, kind: str = "weights") -> torch.Tensor:
    """``torch.empty(shape, dtype)`` on CPU with huge pages asked for where ``kind`` asks
    (:func:`advise_huge_pages`), unwritten."""
    tensor = torch.empty(*shape, dtype=dtype)
    advise_huge_pages(tensor, kind)
    return tensor
