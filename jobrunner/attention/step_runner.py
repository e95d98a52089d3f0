"""One step's forward pass through an attention backend: its fixed-shape runner when the step fits, else eagerly.

The model runner describes a step once (a :class:`~jobrunner.attention.StepLayout` plus the flat
:class:`StepLists`) and hands it to :meth:`StepRunner.run`; it never asks which backend or which path runs.
Each backend brings its own *fixed-shape runner* (:func:`make_step_runner`), the path CUDA graphs replay
(or, with ``capture=False``, its eager twin, which the CPU tests run):

* ``torch``: :class:`~jobrunner.attention.decode_graphs.DecodeGraphs`, decode-only steps padded to a
  (batch, context) bucket;
* ``triton``: :class:`~jobrunner.attention.step_graphs.StepGraphs`, every step padded to a token bucket;
* ``invariant`` (deterministic mode): none; its fixed reduction order is the point, every step runs eagerly.

A step the fixed-shape runner declines (a prompt chunk for the decode graphs, a shape past the buckets) runs
eagerly: the runner's and the backend's integer arrays go to the device in one copy
(:class:`~jobrunner.attention.StepUpload`), then the model runs with the backend's metadata.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from jobrunner.attention.base import AttentionBackend, StepLayout
from jobrunner.attention.decode_graphs import DecodeGraphs
from jobrunner.attention.input_patch import patch_input_ids
from jobrunner.attention.step_graphs import StepGraphs
from jobrunner.attention.torch_backend import TorchBackend
from jobrunner.attention.triton_backend import TritonBackend
from jobrunner.attention.upload import PinnedStaging, StepUpload

# model(input_ids [T], positions [T], metadata, kv_cache) -> hidden [T, hidden]
Model = Callable[..., torch.Tensor]


@dataclass
class StepLists:
    """The runner's flat per-token inputs of one step (host lists, in flat-batch order)."""

    input_ids: list[int]
    positions: list[int]      # the model's rope rows: the position (+ the long table's offset: models/rope.py)
    slots: list[int]          # cache slot each token's K/V goes to
    sample_rows: list[int]    # flat index of every token a row samples from
    # late readback (engine/readback.py): per token, the row of ``source_tokens`` (ids the previous step sampled,
    # still on the device) whose id replaces the placeholder in ``input_ids``; -1 where input_ids holds the id
    input_sources: list[int] | None = None
    source_tokens: torch.Tensor | None = None


@dataclass
class StepForward:
    hidden: torch.Tensor       # [T (or more: padding rows past T are never read), hidden]
    sample_rows: torch.Tensor  # [num sampled tokens] long, on the device
    fixed_shape: bool          # ran through the fixed-shape runner (a CUDA graph replay, or its eager twin)


@dataclass(frozen=True)
class FixedShapeLimits:
    """What a fixed-shape runner is sized for; ``scratch_block`` is the cache block no request owns."""

    block_size: int
    max_num_seqs: int
    max_num_tokens: int
    max_model_len: int
    scratch_block: int
    capture: bool              # True: CUDA graphs; False: the same fixed-shape forward, eagerly


class StepRunner:
    """A backend, its fixed-shape runner (or None) and the model they run; one :meth:`run` per step."""

    def __init__(self, backend: AttentionBackend, model: Model, kv_cache: torch.Tensor,
                 staging: PinnedStaging | None = None, fixed: DecodeGraphs | StepGraphs | None = None) -> None:
        self.backend = backend
        self.model = model
        self.kv_cache = kv_cache
        self.staging = staging
        self.fixed = fixed

    def run(self, layout: StepLayout, lists: StepLists, eager: bool = False) -> StepForward:
        """The step's hidden states and sampling rows; fixed-shape when the step fits, eager otherwise (always with
        ``eager``: a step whose forward reads more than its ids, e.g. image vectors)."""
        if self.fixed is not None and not eager:
            out = self.fixed.run_step(layout, lists)
            if out is not None:
                return StepForward(*out, True)
        upload = StepUpload(self.kv_cache.device, self.staging)
        upload.add("input_ids", lists.input_ids)
        upload.add("positions", lists.positions)
        upload.add("slot_mapping", lists.slots)
        upload.add("sample_rows", lists.sample_rows)
        if lists.input_sources is not None:
            upload.add("input_sources", lists.input_sources)
        meta = self.backend.build(layout, upload)  # adds the backend's arrays, then one copy for all
        t = upload.flush()
        if lists.input_sources is not None:
            patch_input_ids(t["input_ids"], t["input_sources"], lists.source_tokens)
        return StepForward(self.model(t["input_ids"], t["positions"], meta, self.kv_cache), t["sample_rows"], False)

    def warm_up(self) -> int:
        """Capture the fixed-shape runner's graphs now (see its ``warm_up``); how many exist after."""
        return self.fixed.warm_up() if self.fixed is not None else 0

    def stats(self) -> dict:
        """The fixed-shape runner's counters (graphs captured, replays, eager-twin steps, ...); {} without one."""
        return self.fixed.stats() if self.fixed is not None else {}


def make_step_runner(backend: AttentionBackend, model: Model, kv_cache: torch.Tensor,
                     limits: FixedShapeLimits | None = None) -> StepRunner:
    """``backend``'s step runner, with the backend's own fixed-shape runner when ``limits`` are given.

    On CUDA the step's inputs go through a pinned staging buffer kept by the runner (reused every step).
    """
    staging = PinnedStaging() if kv_cache.device.type == "cuda" else None
    fixed = None
    if limits is not None:
        make_fixed = _FIXED_SHAPE_RUNNERS.get(type(backend))
        fixed = make_fixed(backend, model, kv_cache, limits, staging) if make_fixed is not None else None
    return StepRunner(backend, model, kv_cache, staging, fixed)


def _decode_graphs(backend: TorchBackend, model: Model, kv_cache: torch.Tensor, limits: FixedShapeLimits,
                   staging: PinnedStaging | None) -> DecodeGraphs:
    return DecodeGraphs(model, kv_cache, limits.block_size, limits.max_num_seqs,
                        limits.max_model_len, scratch_block=limits.scratch_block, capture=limits.capture)


def _step_graphs(backend: TritonBackend, model: Model, kv_cache: torch.Tensor, limits: FixedShapeLimits,
                 staging: PinnedStaging | None) -> StepGraphs:
    return StepGraphs(model, kv_cache, backend, limits.max_num_seqs, limits.max_num_tokens, limits.max_model_len,
                      scratch_block=limits.scratch_block, capture=limits.capture, staging=staging)


# each backend's fixed-shape runner (a backend without one, the invariant backend, runs every step eagerly)
_FIXED_SHAPE_RUNNERS = {TorchBackend: _decode_graphs, TritonBackend: _step_graphs}
