"""GPU memory by name, for ``cluster.gpu`` (validate's fit check): what a worker's GPU holds, as
``torch.cuda.mem_get_info`` reports its total (nvidia-smi's MiB), or a size given in GB / GiB."""

from __future__ import annotations

import re

MIB = 1024**2
# nvidia-smi's memory.total of each card (MiB); AWS: g6 = L4, g5 = A10G, g6e = L40S, p4d = A100-40GB,
# p4de = A100-80GB, p5 = H100, p5e = H200
GPU_MEMORY_MIB = {
    "T4": 15360, "L4": 23034, "A10G": 23028, "A10": 23028, "L40S": 46068, "A100-40GB": 40960,
    "A100-80GB": 81920, "H100": 81559, "H100-80GB": 81559, "H200": 143771,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GB|GiB)\s*$", re.IGNORECASE)


def gpu_memory_bytes(gpu: str) -> int:
    """Total bytes of ``gpu``: a name of :data:`GPU_MEMORY_MIB` (any case) or a size such as ``24GB`` / ``80GiB``.
    ``ValueError`` naming the known names otherwise."""
    size = _SIZE.match(gpu)
    if size:
        return int(float(size.group(1)) * (10**9 if size.group(2).lower() == "gb" else 1024**3))
    by_name = {name.lower(): mib for name, mib in GPU_MEMORY_MIB.items()}
    if gpu.strip().lower() in by_name:
        return by_name[gpu.strip().lower()] * MIB
    raise ValueError(f"unknown GPU {gpu!r}: name one of {', '.join(GPU_MEMORY_MIB)} or give its memory "
                     "(e.g. '24GB', '80GiB')")
