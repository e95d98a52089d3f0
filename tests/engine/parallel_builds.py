"""Rank builders for the tensor-parallel tests: tiny random models saved as safetensors checkpoints, and
picklable ``build(tp)`` callables (spawned follower processes import this module by name)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobrunner.engine import EngineConfig
from jobrunner.engine.llm_engine import EngineFromSource, LLMEngine

# int8 through its float32 path (dequantized float32 tiles, never the bf16 packed kernel): each rank's partial
# sums rounded to bfloat16 could not match TP = 1 to 1e-5 (as tests/models/test_tensor_parallel_parity.py)
INT8_FLOAT32 = {"JOBRUNNER_CPU_CAPABILITY": "avx2", "JOBRUNNER_QUANT_KERNEL_TOKENS": "int8=0"}


def save_checkpoint(hf_model, tokenizer, path: Path) -> str:
    """``hf_model`` and ``tokenizer`` as a local checkpoint directory (float32 safetensors)."""
    hf_model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


@dataclass(frozen=True)
class WithEnv:
    """A build run with these environment variables set in the rank's process (they stay set there)."""

    build: Any
    env: dict[str, str] = field(default_factory=dict)

    def __call__(self, tp) -> LLMEngine:
        os.environ.update(self.env)
        return self.build(tp)


def rank_build(source: str, quantization: str = "none", **config: Any):
    """A picklable ``build(tp)``: this rank's shard of the checkpoint at ``source`` (float32, CPU); int8 runs its
    float32 path (:data:`INT8_FLOAT32`)."""
    build = EngineFromSource(source, "float32", quantization, EngineConfig(device="cpu", **config))
    return WithEnv(build, INT8_FLOAT32) if quantization == "int8" else build


def single_engine(source: str, quantization: str = "none", **config: Any) -> LLMEngine:
    """The TP = 1 reference: the whole model in this process (int8: set :data:`INT8_FLOAT32` first)."""
    return LLMEngine.from_source(source, "float32", quantization, EngineConfig(device="cpu", **config))


@dataclass(frozen=True)
class DivergingBuild:
    """Rank 1 gets a smaller token budget than rank 0: their first long prefill is scheduled differently."""

    source: str
    config: dict[str, Any]

    def __call__(self, tp) -> LLMEngine:
        budget = 16 if tp.rank == 1 else 64
        config = EngineConfig(device="cpu", max_num_batched_tokens=budget, **self.config)
        return LLMEngine.from_source(self.source, "float32", config=config, tensor_parallel=tp)
