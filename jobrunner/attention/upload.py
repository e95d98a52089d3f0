"""One host->device copy per step for every small integer input of that step.

The model runner and the attention backend each ``add`` named integer lists (token ids, positions, cache
slots, row offsets, block tables, ...); ``flush`` packs them into one int64 staging buffer and copies it to
the device in a single transfer, returning a view per name. On CUDA the staging buffer is pinned and kept
between steps (so the copy is asynchronous and nothing is allocated per step); an event guards the reuse
of the buffer until the previous step's copy has finished.
"""

from __future__ import annotations

import torch


class StepUpload:
    """Collect named int lists, then copy them to ``device`` at once (see the module docstring)."""

    def __init__(self, device: torch.device, staging: PinnedStaging | None = None) -> None:
        self.device = device
        self.staging = staging
        self.parts: dict[str, list[int]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.tensors: dict[str, torch.Tensor] | None = None

    def add(self, name: str, values: list[int], shape: tuple[int, ...] | None = None) -> None:
        """Queue ``values`` (flat) to arrive as ``name`` with ``shape`` (default: flat)."""
        if self.tensors is not None:
            raise RuntimeError(f"StepUpload: {name!r} added after flush")
        self.parts[name] = values
        self.shapes[name] = shape if shape is not None else (len(values),)

    def flush(self, dest: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Device tensors by name (int64), views of ``dest`` (a persistent buffer) when given.

        Later calls return the same tensors.
        """
        if self.tensors is None:
            flat: list[int] = []
            for values in self.parts.values():
                flat.extend(values)
            if self.staging is not None:
                packed = self.staging.copy_to_device(flat, self.device, dest)
            elif dest is not None:
                packed = dest[:len(flat)]
                packed.copy_(torch.tensor(flat, dtype=torch.long))
            else:
                packed = torch.tensor(flat, dtype=torch.long, device=self.device)
            self.tensors, offset = {}, 0
            for name, values in self.parts.items():
                self.tensors[name] = packed[offset:offset + len(values)].view(self.shapes[name])
                offset += len(values)
        return self.tensors


class PinnedStaging:
    """A reusable pinned host buffer (grown on demand) for :class:`StepUpload` on CUDA."""

    def __init__(self) -> None:
        self.host = torch.empty(0, dtype=torch.long)
        self.done: torch.cuda.Event | None = None

    def copy_to_device(self, flat: list[int], device: torch.device, dest: torch.Tensor | None = None
                       ) -> torch.Tensor:
        n = len(flat)
        if self.done is not None:
            self.done.synchronize()  # the previous copy still reads the buffer we are about to overwrite
        if self.host.numel() < n:
            self.host = torch.empty(max(n, 2 * self.host.numel()), dtype=torch.long, pin_memory=True)
        host = self.host[:n]
        host.numpy()[:] = flat
        if dest is None:
            out = host.to(device, non_blocking=True)
        else:
            out = dest[:n]
            out.copy_(host, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()
        return out
