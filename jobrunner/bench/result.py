"""What one timed run measured, and the process' peak memory."""

from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class RunResult:
    """Token counts and wall time of one timed run (warm-up and pilots excluded)."""

    name: str
    seconds: float
    num_requests: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    num_errors: int = 0
    memory: dict[str, float | None] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        total = self.num_prompt_tokens + self.num_output_tokens
        return total / self.seconds if self.seconds > 0 else 0.0

    @property
    def computed_prompt_tokens(self) -> int:
        """Prompt tokens actually run through the model (prefix-cache hits excluded)."""
        return self.num_prompt_tokens - self.num_cached_tokens

    @property
    def cached_token_share(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        extra = out.pop("extra")
        out.update(output_tokens_per_s=self.output_tokens_per_s, total_tokens_per_s=self.total_tokens_per_s,
                   computed_prompt_tokens=self.computed_prompt_tokens, cached_token_share=self.cached_token_share)
        out.update(extra)
        return out


def reset_peak_memory(device: torch.device) -> None:
    """Start a new CUDA peak window (the RSS high-water mark cannot be reset: it covers the whole process)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, float | None]:
    """RSS high-water of the process so far, and CUDA max allocated since the last reset (MiB)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_mib = rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux
    cuda = None
    if device.type == "cuda":
        cuda = torch.cuda.max_memory_allocated(device) / 2**20
    return {"peak_rss_mib": round(rss_mib, 1), "cuda_max_allocated_mib": None if cuda is None else round(cuda, 1)}


def sync(device: torch.device) -> None:
    """Wait for queued GPU work so that wall times are honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
