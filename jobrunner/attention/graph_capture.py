"""Capturing one CUDA graph of a step forward: shared by the decode graphs and the every-step graphs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capture_graph(device: torch.device, pool: Any, forward: Callable[[], torch.Tensor]
                  ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, Any]:
    """``(graph, output, pool)``: ``forward`` captured into a graph allocating from ``pool`` (a new pool if None).

    It first runs twice on a side stream, so that Triton compiles and lazy library initialisation do not land
    in the graph. Those warm-up runs compute the real step: they write the same K/V to the same slots as the
    replay will.
    """
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
