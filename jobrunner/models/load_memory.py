"""The peak memory of a model load: the device's (``torch.cuda.max_memory_allocated``) and the host's own
anonymous memory (``RssAnon``: heap and private copies, not the page cache of a memory-mapped checkpoint).

``with LoadMemory(device) as memory: ...`` samples ``/proc/self/status`` on a background thread every few
milliseconds (the transient copies of a quantized layer last that long); ``memory.to_dict()`` is what the
manifest's ``model.load_memory`` and the worker's start-up breakdown record. Off Linux the host figures are None.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

_STATUS = Path("/proc/self/status")


def host_anon_bytes() -> int | None:
    """This process's resident anonymous memory in bytes (``RssAnon``), or None where /proc cannot say."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class LoadMemory:
    """Peak device and host memory over a ``with`` block, each also as the rise over its value at entry."""

    def __init__(self, device: torch.device | str, interval_s: float = 0.002) -> None:
        self.device = torch.device(device)
        self.interval_s = interval_s
        self.host_baseline: int | None = None
        self.host_peak: int | None = None
        self.device_baseline: int | None = None
        self.device_peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> LoadMemory:
        self.host_baseline = self.host_peak = host_anon_bytes()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.device_baseline = torch.cuda.memory_allocated(self.device)
        if self.host_baseline is not None:
            self._thread = threading.Thread(target=self._sample, name="load-memory", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._record(host_anon_bytes())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.device_peak = torch.cuda.max_memory_allocated(self.device)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._record(host_anon_bytes())

    def _record(self, value: int | None) -> None:
        if value is not None and (self.host_peak is None or value > self.host_peak):
            self.host_peak = value

    @property
    def host_rise(self) -> int | None:
        """Peak anonymous memory over the baseline at entry (bytes)."""
        return None if self.host_peak is None else self.host_peak - self.host_baseline

    @property
    def device_rise(self) -> int | None:
        """Peak device memory allocated over what was allocated at entry (bytes; CUDA only)."""
        return None if self.device_peak is None else self.device_peak - self.device_baseline

    def to_dict(self) -> dict[str, Any]:
        """Plain values for the manifest: peaks and rises in bytes (None where not measured)."""
        return {"host_anon_peak_bytes": self.host_peak, "host_anon_rise_bytes": self.host_rise,
                "device_peak_bytes": self.device_peak, "device_rise_bytes": self.device_rise}
