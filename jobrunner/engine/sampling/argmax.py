"""Native row argmax on CPU for the greedy sampler (``kernels/csrc/rowops/row_argmax.c``), straight on float32
or bf16 logits.

A greedy decode step used to widen the logits to float32 (``logits.float()``: SmolLM2's 64 x 49,152 bf16 rows,
a 12.6 MB copy) and then run ``max(dim=-1)``: about 3.5 ms of a 63 ms step on 2 cores. The C kernel reads the
model's own dtype once (bf16 widens to float32 exactly, so the argmax is the same), vectorized (AVX-512 / AVX2,
else plain C) with OpenMP over rows (a row split across threads when rows are fewer than threads), and returns
what ``x.max(dim=-1).indices`` returns: the first index of the maximum, NaN counting as the maximum (the first
NaN wins), -0 equal to +0. Exact, so also batch- and thread-count-invariant (deterministic mode keeps it).

Built by :func:`jobrunner.kernels.load` for this CPU's capability (``JOBRUNNER_CPU_CAPABILITY``
forces one); other devices or dtypes, non-contiguous rows, a missing compiler, a failed build or
``JOBRUNNER_NATIVE_ARGMAX=0`` take :func:`jobrunner.engine.sampling.row_argmax` (torch).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from jobrunner.engine.sampling import row_argmax
from jobrunner.kernels import capability_key, is_off, load, source_path

ARGMAX_ENV = "JOBRUNNER_NATIVE_ARGMAX"
SOURCE = source_path("row_argmax")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@functools.cache
def _library(capability: str) -> ctypes.CDLL | str:
    return load("row_argmax")


def argmax_library() -> ctypes.CDLL | str:
    """The built library for this CPU's capability, or why there is none (``"JOBRUNNER_NATIVE_ARGMAX=0"``, or
    the build's failure). Asked on every call; the capability is detected once per value of
    ``JOBRUNNER_CPU_CAPABILITY``."""
    if is_off(ARGMAX_ENV):
        return f"{ARGMAX_ENV}=0"
    return _library(capability_key())



def native_row_argmax(x: torch.Tensor) -> torch.Tensor | None:
    """``x.max(dim=-1).indices`` of a 2-D CPU float32 / bf16 tensor with contiguous rows, by the C kernel; None
    where it cannot run (another device, dtype or layout, an empty row, autograd, or no library)."""
    if (x.device.type != "cpu" or x.dtype not in DTYPES or x.dim() != 2 or x.shape[1] == 0
            or (x.shape[1] > 1 and x.stride(1) != 1) or (x.requires_grad and torch.is_grad_enabled())):
        return None
    lib = argmax_library()
    if isinstance(lib, str):
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0]:
        rc = lib.jr_row_argmax(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
                               DTYPES[x.dtype], torch.get_num_threads())
        if rc:
            raise RuntimeError(f"native row argmax refused its shape {tuple(x.shape)} (code {rc})")
    return out


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of every row of ``logits`` [N, V] in their own dtype: the native kernel where it runs, else
    :func:`row_argmax` (torch)."""
    out = native_row_argmax(logits)
    return row_argmax(logits) if out is None else out
