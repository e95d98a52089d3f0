"""Joining a tensor-parallel group: torch.distributed over TCP, a gloo group for objects, CPU cores pinned.

A rank is described by :class:`RankSpec` (who it is, where rank 0 listens, which cores or GPU it owns) and joins
with :func:`join_group`, which returns the :class:`~jobrunner.models.parallel.TensorParallel` its model shards
and collectives use. Tensor collectives go over ``TensorParallel.group`` (nccl on CUDA, gloo on CPU); the
per-step commands and the divergence guard always travel over a gloo group (:func:`object_group`), so a CUDA
group never moves Python objects through the GPU. Every collective carries ``timeout_s``: a lost rank makes the
others' next collective raise instead of hang.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from jobrunner.models.parallel import TensorParallel

BACKENDS = ("auto", "gloo", "nccl")

# the gloo group for objects (commands, fingerprints) of the group this process joined; one group per process,
# as torch.distributed has one default group per process. Set by join_group, cleared by leave_group.
_joined: dict[str, Any] = {}


@dataclass(frozen=True)
class RankSpec:
    """One rank of a tensor-parallel group.

    ``init_method``: ``tcp://<rank-0 host>:<port>`` (rank 0 listens there; :func:`free_port` picks a port).
    ``backend``: ``auto`` (nccl on CUDA, gloo on CPU), ``gloo`` or ``nccl``; objects always go over gloo.
    ``timeout_s``: the limit of every collective (a lost rank fails the others' next one with an error).
    ``cpu_cores``: a CPU rank's cores: its threads are pinned there and ``torch.set_num_threads`` is their
    number (empty: left as they are). ``device_index``: a GPU rank's local CUDA device.
    """

    rank: int
    world: int
    init_method: str
    backend: str = "auto"
    timeout_s: float = 600.0
    cpu_cores: tuple[int, ...] = ()
    device_index: int | None = None

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"RankSpec: rank {self.rank} is not in 0..{self.world - 1} (world {self.world})")
        if self.backend not in BACKENDS:
            raise ValueError(f"RankSpec.backend must be one of {'|'.join(BACKENDS)}, got {self.backend!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"RankSpec.timeout_s must be > 0, got {self.timeout_s}")

    @property
    def is_leader(self) -> bool:
        """Rank 0: the engine the worker talks to."""
        return self.rank == 0

    def resolved_backend(self) -> str:
        """The tensor backend: ``auto`` is nccl when this rank has a CUDA device, gloo otherwise."""
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.device_index is not None and torch.cuda.is_available() else "gloo"


def free_port(host: str = "") -> int:
    """A TCP port free on this host now (the OS picks it), for rank 0's ``init_method``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def pin_cores(cores: tuple[int, ...]) -> tuple[set[int], int]:
    """Pin this process's calling thread (and the threads it starts later) to ``cores`` and run torch's
    intra-op pool on that many threads; the affinity and thread count before, to restore them."""
    before = (os.sched_getaffinity(0), torch.get_num_threads())
    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(len(cores))
    return before


def join_group(rank: RankSpec) -> TensorParallel:
    """Join the group (blocks until all ``world`` ranks arrive, at most ``timeout_s``) and return this rank's
    :class:`~jobrunner.models.parallel.TensorParallel`. Pins ``cpu_cores`` first; selects ``device_index``.
    ``world == 1`` joins nothing and returns ``SINGLE``."""
    from jobrunner.models.parallel import SINGLE, TensorParallel

    if rank.cpu_cores:
        _joined["restore"] = pin_cores(rank.cpu_cores)
    if rank.world == 1:
        return SINGLE
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("this process is in a torch.distributed group already (leave_group() it first)")
    backend = rank.resolved_backend()
    if backend == "nccl":
        torch.cuda.set_device(rank.device_index or 0)
    timeout = timedelta(seconds=rank.timeout_s)
    dist.init_process_group(backend, init_method=rank.init_method, rank=rank.rank, world_size=rank.world,
                            timeout=timeout)
    world_group = dist.group.WORLD
    _joined["objects"] = world_group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return TensorParallel(rank.rank, rank.world, group=world_group)


def object_group(tp: TensorParallel) -> Any:
    """The gloo group that carries this rank's commands and fingerprints (``tp.group`` on CPU)."""
    return _joined.get("objects", tp.group)


def leave_group() -> None:
    """Leave the group this process joined (if any) and give back the cores' affinity and thread count."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _joined.pop("objects", None)
    restore = _joined.pop("restore", None)
    if restore is not None:
        os.sched_setaffinity(0, restore[0])
        torch.set_num_threads(restore[1])
