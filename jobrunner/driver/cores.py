"""Which CPU cores a tensor-parallel rank pins on its node.

Ray reserves CPU *amounts* per bundle, not core numbers, so the ranks on one node (of one group, or of several
groups and jobs sharing the node) choose their cores themselves: each rank takes the lowest-numbered cores of
its allowed set (its affinity) that no other process holds, by an exclusive `flock` on one small file per core
(`<temp>/jobrunner-cores-<uid>/core<N>.lock`). A lock lives as long as the file descriptor: the kernel releases
it when the process ends, `kill -9` included, so a dead rank's cores are free for its replacement. Lowest first
keeps a rank's cores contiguous (usually one NUMA node's, as Linux numbers cores node by node). A rank that
finds fewer free cores than it asked for pins nothing (it shares the node's cores, as an untensored worker
does) and says so in its record (``cores: []``).
"""

from __future__ import annotations

import fcntl
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class CoreClaim:
    """Cores held by this process (``cores`` empty: none claimed, nothing pinned); `release()` lets go."""

    cores: tuple[int, ...] = ()
    fds: list[int] = field(default_factory=list)

    def release(self) -> None:
        for fd in self.fds:
            os.close(fd)  # closing the descriptor drops its flock
        self.fds.clear()
        self.cores = ()


def lock_dir() -> Path:
    """Where the per-core lock files live (one folder per user; made on first use)."""
    path = Path(tempfile.gettempdir()) / f"jobrunner-cores-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def cores_per_rank(num_cpus_per_worker: float, world: int) -> int:
    """Cores one rank pins: its bundle's CPUs (``num_cpus_per_worker / world``), at least one."""
    return max(1, math.floor(num_cpus_per_worker / world + 1e-9))


def claim_cores(count: int, folder: Path | None = None) -> CoreClaim:
    """Take ``count`` free cores of this process's allowed set (lowest first); an empty claim if fewer are free."""
    folder = folder or lock_dir()
    claim = CoreClaim()
    held: list[int] = []
    for core in sorted(os.sched_getaffinity(0)):
        if len(held) == count:
            break
        fd = os.open(folder / f"core{core}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        held.append(core)
        claim.fds.append(fd)
    claim.cores = tuple(held)
    if len(held) < count:
        claim.release()
    return claim
