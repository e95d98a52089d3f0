"""Fused row-wise ops of the decoder on CPU: RMSNorm (with the residual add), rotary in place, SiLU * up.

A decoder layer runs about thirty small torch kernels besides its GEMMs and attention (norms, rotary, the
activation, the residual adds), each a pass over the activations plus an allocation; on a 2-core CPU they were
17-18% of a step on SmolLM2-135M (``jobrunner bench --profile``, "other"). ``kernels/csrc/rowops/fused_ops.c`` does each
group in one pass (its doc lists the ops and the roundings kept). Used for float32 and bfloat16 CPU tensors
outside autograd; everything else, a missing compiler, a failed build or ``JOBRUNNER_FUSED_OPS=0`` takes the
torch ops (the reference: the parity tests compare both). Built by
:func:`jobrunner.kernels.load` for this CPU, without floating-point contraction.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from jobrunner.kernels import capability_key, is_off, load, source_path

FUSED_ENV = "JOBRUNNER_FUSED_OPS"
SOURCE = source_path("fused_ops")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


@functools.cache
def _library(capability: str) -> ctypes.CDLL | str:
    return load("fused_ops")


def fused_library() -> ctypes.CDLL | str:
    """The built library for this CPU's capability, or why there is none (asked on every op, so the capability
    is detected once per value of ``JOBRUNNER_CPU_CAPABILITY``)."""
    if is_off(FUSED_ENV):
        return f"{FUSED_ENV}=0"
    return _library(capability_key())



def _usable(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    t = tensors[0]  # is_cpu, not device objects: this runs ~4 times a layer, a device compare costs ~0.3 us
    if not t.is_cpu or t.dtype not in DTYPES or torch.is_grad_enabled() and t.requires_grad:
        return None
    for x in tensors:
        if x.dtype != t.dtype or not x.is_cpu:
            return None
    lib = fused_library()
    return None if isinstance(lib, str) else lib


def _check(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"fused {what} kernel refused its shape (code {rc})")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(norm(x + add), x + add)`` (``add`` None: ``(norm(x), x)``), or None where the torch ops must run."""
    operands = (x, weight) if add is None else (x, weight, add)
    lib = _usable(*operands)
    if lib is None or not x.is_contiguous() or not weight.is_contiguous() or (add is not None and (
            not add.is_contiguous() or add.shape != x.shape)) or weight.shape != x.shape[-1:]:
        return None
    n = x.shape[-1]
    out = torch.empty_like(x)
    total = torch.empty_like(x) if add is not None else x
    _check(lib.jr_rms_norm(x.data_ptr(), None if add is None else add.data_ptr(),
                           None if add is None else total.data_ptr(), out.data_ptr(), weight.data_ptr(),
                           x.numel() // max(n, 1), n, eps, DTYPES[x.dtype], torch.get_num_threads()), "rms_norm")
    return out, total


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate ``q`` [T, Hq, D] and ``k`` [T, Hk, D] in place (views of one qkv row are fine); cos / sin
    [T, 1, D]. False where the torch ops must run (nothing was changed)."""
    lib = _usable(q, k, cos, sin)
    if lib is None or q.dim() != 3 or k.dim() != 3 or cos.shape != (q.shape[0], 1, q.shape[2]):
        return False
    D = q.shape[2]
    if q.stride()[1:] != (D, 1) or k.stride()[1:] != (D, 1) or not (cos.is_contiguous() and sin.is_contiguous()):
        return False
    if sin.shape != cos.shape or k.shape[0] != q.shape[0] or k.shape[2] != D:
        return False
    _check(lib.jr_rotary(q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.shape[0], q.shape[1],
                         k.shape[1], D, q.stride(0), k.stride(0), DTYPES[q.dtype], torch.get_num_threads()), "rotary")
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of ``gate_up`` [..., 2I] (gate first), or None where the torch ops must run."""
    lib = _usable(gate_up)
    if lib is None or not gate_up.is_contiguous() or gate_up.shape[-1] % 2:
        return None
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    _check(lib.jr_silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // max(2 * inter, 1), inter,
                           DTYPES[gate_up.dtype], torch.get_num_threads()), "silu_mul")
    return out
