"""Quantize-at-load as a streamed loader's transform: each decoder layer is quantized the moment its last
tensor is loaded, so the float copy of the model never exists whole (peak: the quantized layers so far plus one
layer in float). Pass :class:`QuantizeAtLoad` as ``transform`` to ``jobrunner.models.loader.load_weights``
(it follows ``models/load_stream.LoadTransform`` by its methods; quant imports no model code).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from jobrunner.quant.apply import QuantSession
from jobrunner.quant.report import QuantReport


class QuantizeAtLoad:
    """:func:`jobrunner.quant.quantize_model`'s result, reached one load unit at a time.

    Built on the model while it is still on ``meta``; ``device`` is where its weights will be loaded (the
    kernels are chosen for it). The keyword options are :func:`~jobrunner.quant.quantize_model`'s.
    """

    def __init__(self, model: torch.nn.Module, scheme: str, device: torch.device, **options: Any) -> None:
        self.device = torch.device(device)
        self.session = QuantSession(model, scheme, device=self.device, **options)
        self.scheme = self.session.scheme  # read by a tensor-parallel load (models/parallel/shard.py)
        self.report: QuantReport | None = None

    def replaces(self, module_name: str, module: torch.nn.Module) -> bool:
        """Nothing: every module loads its float weights first, then is quantized."""
        return False

    def install(self, model: torch.nn.Module, module_name: str, tensors: dict, device: torch.device) -> None:
        """Never called (:meth:`replaces` takes no module)."""
        raise AssertionError(f"QuantizeAtLoad replaces no module, asked to install {module_name}")

    def unit_loaded(self, model: torch.nn.Module, unit_name: str) -> None:
        """Quantize the linears (and untied embeddings) of the unit just loaded; its float weights go."""
        self.session.quantize_under(unit_name)
        if self.device.type == "cpu":
            release_freed_heap()

    def finish(self, model: torch.nn.Module) -> None:
        """The tied head and embedding, anything not yet handed over, and the report."""
        self.report = self.session.finish()


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc (macOS, musl): nothing to trim
        return None


def release_freed_heap() -> None:
    """Give freed heap pages back to the system (glibc ``malloc_trim``). A quantized layer's float weights are
    freed between the quantized buffers made after them; glibc keeps such holes resident, which measured
    ~10 MB of a 41 MB model's int4 load (bench/load_peak.py). A few ms per call; a no-op off glibc."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
