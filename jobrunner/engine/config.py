"""Engine configuration: one frozen dataclass, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches, caches and where it runs.

    Memory for the KV cache: on CPU ``kv_cache_memory_bytes`` (default 2 GiB); on CUDA a fraction
    ``gpu_memory_utilization`` of the memory left free after the weights are loaded. ``num_kv_blocks``
    overrides both (tests use it to force preemption).

    ``attention_backend``: ``torch`` (gather + SDPA, runs anywhere), ``triton`` (one Triton kernel per layer
    over the paged cache; CUDA only, falls back to torch with a warning elsewhere) or ``auto`` (= ``torch``
    until ``scripts/gpu_check.sh`` has passed on a GPU; see docs/engine.md).

    ``use_cuda_graphs`` (opt-in, off by default until a GPU run has passed): on CUDA, fixed-shape steps replay
    CUDA graphs (torch backend: decode-only steps, :mod:`jobrunner.engine.decode_graphs`; triton backend:
    every step, :mod:`jobrunner.engine.step_graphs`); ignored on CPU. ``static_decode``: run the same
    fixed-shape path without graphs, on any device (slower on CPU; tests use it to check that path).

    ``speculative``: ``off`` (default), ``ngram`` (prompt-lookup drafts verified every decode step), ``auto``
    (n-gram drafts only where the measured acceptance and the batch size say a step gains;
    :mod:`jobrunner.engine.speculative`). ``num_speculative_tokens``: most drafted tokens per request per step.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.85
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    use_cuda_graphs: bool = False
    static_decode: bool = False
    seed: int = 0
    speculative: str = "off"
    num_speculative_tokens: int = 4

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"EngineConfig.num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError("EngineConfig.kv_cache_memory_bytes must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("EngineConfig.gpu_memory_utilization must be in (0, 1]")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError("EngineConfig.attention_backend must be auto|torch|triton, "
                             f"got {self.attention_backend!r}")
        _check_speculative(self.speculative, self.num_speculative_tokens)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"EngineConfig.dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}")

    @classmethod
    def from_dict(cls, values: dict) -> EngineConfig:
        """Build from a plain dict, naming any unknown key."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown engine setting(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)


SPECULATIVE_MODES = ("off", "auto", "ngram")


def _check_speculative(mode: str, num_tokens: int) -> None:
    if not isinstance(mode, str) or mode not in SPECULATIVE_MODES:
        raise ValueError(f"EngineConfig.speculative must be one of {'|'.join(SPECULATIVE_MODES)}, got {mode!r} "
                         "(draft-model speculation is not implemented yet)")
    if not 1 <= num_tokens <= 16:
        raise ValueError(f"EngineConfig.num_speculative_tokens must be in 1..16, got {num_tokens}")
