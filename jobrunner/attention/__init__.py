"""Attention backends over the paged KV cache, below both the model and the engine.

``torch`` (:mod:`.torch_backend`): gather + ``scaled_dot_product_attention``; runs everywhere and is the
default on CUDA. ``cpu_paged`` (:mod:`.cpu_paged`): native code reading the cache in place on CPU (what
``auto`` runs for float32 and bf16 on CPU: the model runner resolves ``auto``; docs/bench.md says what was
measured). ``triton`` (:mod:`.triton_backend`): one Triton kernel launch per layer
reading the cache in place; CUDA only (or Triton's interpreter), opt-in until a GPU check has passed. The model calls
:func:`paged_attention` with whatever metadata the runner built; it never names a backend. Each backend's
fixed-shape (CUDA-graph) path sits behind :class:`StepRunner` too (:mod:`.step_runner`): the engine's model
runner hands every step to one ``run`` and never asks which backend or path runs it.
"""

from __future__ import annotations

from jobrunner.attention.base import AttentionBackend, AttentionMetadata, StepLayout, paged_attention
from jobrunner.attention.step_runner import FixedShapeLimits, StepForward, StepLists, StepRunner, make_step_runner
from jobrunner.attention.upload import StepUpload

BACKENDS = ("auto", "torch", "cpu_paged", "triton")

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "FixedShapeLimits", "StepForward", "StepLayout",
           "StepLists", "StepRunner", "StepUpload", "make_backend", "make_step_runner", "paged_attention"]


def make_backend(name: str, num_heads: int, num_kv_heads: int, block_size: int, device, max_num_seqs: int = 256,
                 max_model_len: int = 8192, head_dim: int = 64, dtype=None, split_decode: str = "off",
                 cache_dtype=None) -> AttentionBackend:
    """The backend called ``name`` (``auto`` here is ``torch``; the model runner resolves ``auto`` first).
    Raises ``RuntimeError`` if ``triton`` or ``cpu_paged`` can't run here.

    ``max_num_seqs`` (rows per step) and ``max_model_len`` size the triton backend's device block table;
    ``dtype`` (the model's) lets ``cpu_paged`` choose where bf16 prompt chunks run; ``split_decode``
    (off | auto | on) is the triton backend's split-K decode mode (:mod:`.split_decode`); ``cache_dtype`` (the KV
    cache's, when it differs: fp8, :mod:`.kv_quant`) keeps ``cpu_paged`` off the AMX kernels, which read bf16
    caches only.
    """
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "triton":
        from jobrunner.attention.triton_backend import TritonBackend, triton_unavailable_reason

        reason = triton_unavailable_reason(device)
        if reason:
            raise RuntimeError(reason)
        return TritonBackend(num_heads, num_kv_heads, block_size, device, max_num_seqs, max_model_len,
                             split_decode=split_decode)
    if name == "cpu_paged":
        from jobrunner.attention.cpu_paged import make_cpu_paged_backend

        return make_cpu_paged_backend(device, head_dim, dtype, num_heads, num_kv_heads, block_size, cache_dtype)
    from jobrunner.attention.torch_backend import TORCH_BACKEND

    return TORCH_BACKEND
