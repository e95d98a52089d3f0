"""What a worker runs on (CPU model, cores, GPU name and count), recorded in the manifest's worker entries so
reports can name the hardware of each run."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else platform.processor(), else the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def gpus() -> list[str]:
    """Names of the CUDA devices this process sees (empty without torch or CUDA)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - no driver, no torch: no GPU to name
        return []


def describe_hardware() -> dict[str, str | int]:
    """Flat manifest fields: cpu_model, num_cpus (of the machine), gpu_name ('' if none), num_gpus (visible)."""
    names = gpus()
    return {"cpu_model": cpu_model(), "num_cpus": os.cpu_count() or 0,
            "gpu_name": names[0] if names else "", "num_gpus": len(names)}
