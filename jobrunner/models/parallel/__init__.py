"""Tensor parallelism of our models: one model split across ``world`` ranks (GPUs or CPU core groups).

:class:`TensorParallel` is what a model (and its loader) needs to know of its group: its rank, the world size
and the ``torch.distributed`` process group its collectives run on. A model built with ``SINGLE`` (world 1)
is the whole model and never calls a collective. :mod:`jobrunner.models.parallel.plan` says how a config
splits (pure numbers); :mod:`jobrunner.models.parallel.layers` holds the split layers and
:mod:`jobrunner.models.parallel.shard` slices checkpoint tensors to a rank's rows / columns while they stream.

The engine side (ranks, the per-step command broadcast, the local launcher) is ``jobrunner.engine.parallel``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group.

    ``group``: the ``torch.distributed`` process group the tensor collectives run on (None: the default group;
    unused when ``world == 1``).
    """

    rank: int
    world: int
    group: Any = None

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"tensor parallel rank {self.rank} is not in a world of {self.world}")

    @property
    def is_parallel(self) -> bool:
        """More than one rank: the model is split and its forward runs collectives."""
        return self.world > 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t`` (a no-op at world 1)."""
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t, group=self.group)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` concatenated along the last dimension, in rank order (``t`` itself at world 1)."""
        if self.world == 1:
            return t
        import torch.distributed as dist

        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel(0, 1)

__all__ = ["SINGLE", "TensorParallel"]
