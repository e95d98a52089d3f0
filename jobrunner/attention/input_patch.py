"""Input ids that are still on the device: one-step-late readback (engine/readback.py) leaves the ids a step
sampled on the device, and the next step's rows that decode them take them there, just before the forward."""

from __future__ import annotations

import torch


def patch_input_ids(input_ids: torch.Tensor, sources: torch.Tensor, tokens: torch.Tensor) -> None:
    """``input_ids[t] = tokens[sources[t]]`` wherever ``sources[t] >= 0``, in place on the device (nothing waits).

    input_ids, sources: ``[T]`` int64 on the device; tokens: ``[N]`` ids sampled by the previous step (N >= 1).
    """
    picked = tokens.to(input_ids.dtype).index_select(0, sources.clamp(min=0))
    input_ids.copy_(torch.where(sources >= 0, picked, input_ids))
