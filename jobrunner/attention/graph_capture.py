"""Capturing one CUDA graph of a step forward, and the guard over the weights the graphs read: shared by the
decode graphs and the every-step graphs.

A graph replays the kernels it recorded on the addresses they read at capture. Two things would make that
silently wrong, and both are handled here rather than left to callers:

- **Autograd recorded in the graph.** A forward run with grad enabled over parameters that require grad keeps
  its activations for a backward that never comes; inside a graph they live in the private pool, about 6 MB
  per token at the Llama-3-8B shape, enough to exhaust the memory the KV cache left. Every capture (the
  warm-up runs and the recorded run) happens under ``torch.no_grad()``, whoever calls it.
- **Weights swapped after capture** (quantizing a built engine's model, packing its layers): the graph would
  replay the old weights' freed memory. :class:`WeightsGuard` remembers the data pointers of every parameter and
  buffer at capture; the graph runners ask it before each replay and drop their graphs (recaptured on use)
  when the weights moved. Asking costs one integer comparison: the pointers are read again only after some
  module, parameter or buffer was registered anywhere in the process (torch's global registration hooks count
  them). Replacing a tensor's ``.data`` in place is not seen; nothing in jobrunner does it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules import module as torch_module

log = logging.getLogger(__name__)

_registrations = 0  # modules, parameters and buffers registered anywhere since import


def _count_registration(*_args: Any) -> None:
    global _registrations
    _registrations += 1


torch_module.register_module_module_registration_hook(_count_registration)
torch_module.register_module_parameter_registration_hook(_count_registration)
torch_module.register_module_buffer_registration_hook(_count_registration)


def weights_key(model: Any) -> tuple[int, ...]:
    """The data pointers of every parameter and buffer of ``model``, in order (none for a plain callable)."""
    if not isinstance(model, torch.nn.Module):
        return ()
    return tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))


class WeightsGuard:
    """Whether ``model``'s weights still sit where they were when :meth:`capture_started` was last called."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.seen = _registrations
        self.key = weights_key(model)
        self.num_moves = 0

    def capture_started(self) -> None:
        """A graph is about to be recorded over the weights as they are now."""
        self.seen, self.key = _registrations, weights_key(self.model)

    def moved(self) -> bool:
        """True (once per move) when the weights changed since the last capture."""
        if _registrations == self.seen:
            return False
        self.seen = _registrations
        key = weights_key(self.model)
        if key == self.key:
            return False
        self.key = key
        self.num_moves += 1
        log.warning("the model's weights changed after CUDA graphs were captured (a module swapped, e.g. "
                    "quantized after the engine was built): the graphs are dropped and captured again")
        return True


def drop_graphs_if_weights_moved(runner: Any) -> None:
    """A graph runner's (``graphs``, ``pool``, ``weights``) graphs dropped, to be captured again on use, when its
    model's weights moved since the last capture."""
    if runner.graphs and runner.weights.moved():
        runner.graphs.clear()
        runner.pool = None


def capture_graph(device: torch.device, pool: Any, forward: Callable[[], torch.Tensor]
                  ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, Any]:
    """``(graph, output, pool)``: ``forward`` captured into a graph allocating from ``pool`` (a new pool if None).

    It first runs twice on a side stream, so that Triton compiles and lazy library initialisation do not land
    in the graph. Those warm-up runs compute the real step: they write the same K/V to the same slots as the
    replay will. Everything runs under ``torch.no_grad()`` (module doc).
    """
    with torch.no_grad():
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(device).wait_stream(stream)
        if pool is None:
            pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a Ray worker's other threads (uploads, heartbeats) may touch CUDA during a capture
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            output = forward()
    return graph, output, pool
