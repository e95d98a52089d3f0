"""Engine configuration: one frozen dataclass, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from jobrunner.engine.settings import check_settings, setting


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches, caches and where it runs.

    Memory for the KV cache: on CPU ``kv_cache_memory_bytes`` (default 2 GiB); on CUDA what is left of
    ``gpu_memory_utilization`` x ``gpu_share`` x the card's total memory once the weights, a measured step's
    activation peak and the CUDA graphs' pool are taken out (:mod:`jobrunner.engine.memory_plan`).
    ``gpu_share`` (internal; the driver sets it from ``cluster.num_gpus_per_worker`` below 1) is this engine's
    fraction of the card. ``num_kv_blocks`` overrides both (tests use it to force preemption).

    ``attention_backend``: ``torch`` (gather + SDPA, runs anywhere), ``cpu_paged`` (native code reading the
    paged cache in place; CPU only, falls back to torch with a warning where it cannot build), ``triton`` (one
    Triton kernel per layer over the paged cache; CUDA only, falls back to torch with a warning elsewhere) or
    ``auto`` (``cpu_paged`` for float32 and bf16 on CPU, where it was measured faster on every benchmark
    workload; ``torch`` otherwise; see docs/engine.md).

    ``use_cuda_graphs`` (``auto`` = off for our engine until a GPU run has passed; :meth:`graphs_on`): on
    CUDA, fixed-shape steps replay CUDA graphs (torch backend: decode-only steps,
    :mod:`jobrunner.attention.decode_graphs`; triton backend: every step, :mod:`jobrunner.attention.step_graphs`);
    ignored on CPU. ``static_decode``: run the same
    fixed-shape path without graphs, on any device (slower on CPU; tests use it to check that path).

    Fields made with ``setting(...)`` are the job spec's ``engine:`` keys (:mod:`jobrunner.engine.settings`):
    a new user setting is one such field here; plain fields are internal.

    ``kv_cache_dtype``: ``auto`` (the model's dtype) or an fp8 format (:mod:`jobrunner.attention.kv_quant`: codes
    plus a float32 scale per (token, kv head); every attention backend reads it, the AMX kernels excepted).

    ``deterministic``: batch-invariant execution (:mod:`jobrunner.engine.invariant`): a row's tokens depend
    only on its prompt, settings and seed, never on ``max_num_seqs``, ``max_num_batched_tokens``, chunked
    prefill, prefix-cache hits, preemption or what else is batched with it (docs/engine.md, *Deterministic
    mode*). Costs throughput; off by default.

    ``speculative``: ``auto`` (default: n-gram drafts only where the measured acceptance and the batch size say a
    step gains; :mod:`jobrunner.engine.speculative`), ``ngram`` (prompt-lookup drafts verified every decode step),
    ``off``, or a model source (alias, local dir, Hub id, storage URL): a small *draft model* on the same tokenizer
    proposes the drafts, planned like ``auto`` (:mod:`jobrunner.engine.speculative.draft_model`;
    ``draft_quantization`` quantizes it when loaded). ``num_speculative_tokens``: most drafted tokens per request
    per step. ``draft_every_step`` (internal: tests and benchmarks): a draft model's drafts are verified on every
    decode step, as ``ngram`` does.
    """

    max_num_seqs: int = setting(64, description="Most requests decoding at once.", ge=1)
    max_num_batched_tokens: int = setting(2048, description="Token budget of one engine step.", ge=1)
    block_size: int = setting(16, description="Tokens per KV-cache block.", ge=1)
    kv_cache_memory_bytes: int | None = setting(None, description="KV-cache size on CPU.", ge=1)
    gpu_memory_utilization: float = setting(
        0.85, description="Share of the GPU's total memory this engine may use: weights, a measured step's "
        "activations, CUDA graphs and the KV cache (which gets what is left). A worker with num_gpus_per_worker "
        "below 1 gets this share of its fraction of the card (docs/engine.md).", gt=0.0, le=1.0)
    gpu_share: float = 1.0  # internal: this engine's fraction of its GPU (cluster.num_gpus_per_worker, if < 1)
    num_kv_blocks: int | None = setting(None, description="Exact number of KV blocks.", ge=1)
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2"] = setting(
        "auto", description="KV-cache element type: auto (the model's dtype) or fp8_e4m3 / fp8_e5m2 (fp8 codes with "
        "a float32 scale per token and kv head: about half the bytes, so nearly twice the blocks in the same memory "
        "and half the bytes decode attention reads; docs/engine.md).")
    enable_prefix_caching: bool = setting(True, description="Reuse KV blocks of shared prefixes.")
    max_model_len: int | None = setting(None, description="Cap on prompt + output tokens.", ge=1)
    device: str = setting("auto", description="auto, cpu or cuda.")
    dtype: str = "auto"  # internal: the job spec sets it from model.dtype
    attention_backend: Literal["auto", "torch", "cpu_paged", "triton"] = setting(
        "auto", description="Attention kernel: torch (runs anywhere), cpu_paged (native, reads the KV cache in "
        "place; CPU), triton (CUDA; both fall back to torch where they cannot run) or auto (cpu_paged for "
        "float32 / bf16 on CPU, else torch; docs/engine.md).")
    use_cuda_graphs: bool | Literal["auto"] = setting(
        "auto", description="On CUDA, replay fixed-shape steps from CUDA graphs (ignored on CPU). auto: on for "
        "engine.backend vllm on CUDA (vLLM compiles and captures its graphs), off for our engine until a GPU check "
        "has passed (docs/engine.md); true / false force it.")
    static_decode: bool = False
    seed: int = 0
    deterministic: bool = setting(
        False, description="Batch-invariant execution: the same spec and seed give byte-identical rows whatever "
        "max_num_seqs, max_num_batched_tokens, workers, retries, preemption or resume (slower; docs/engine.md).")
    speculative: str = setting(
        "auto", description="Speculative decoding: auto (n-gram drafts only where the measured acceptance and batch "
        "size say a step gains: the drain tail), ngram (prompt-lookup drafts every decode step), off, or a draft "
        "model's source (alias, local dir, Hub id, storage URL; same tokenizer as model.source), planned like auto "
        "(docs/engine.md).")
    num_speculative_tokens: int = setting(4, description="Most draft tokens per row per step.", ge=1, le=16)
    draft_quantization: Literal["none", "int8", "int8_weight_only", "int4", "fp8", "w8a8"] = setting(
        "none", description="Quantization applied when loading the draft model (engine.speculative = a model "
        "source); as model.quantization.")
    tensor_parallel_size: int = setting(
        1, description="Ranks one worker's model is split across (attention heads, MLP, vocabulary): one GPU each, "
        "or a share of the worker's CPU cores; cluster.num_gpus_per_worker must equal tensor_parallel_size x "
        "pipeline_parallel_size on GPUs (docs/engine.md, Tensor parallel).", ge=1)
    pipeline_parallel_size: int = setting(
        1, description="Pipeline stages of one worker's model (layers split across stages, possibly across "
        "nodes): engine.backend vllm only.", ge=1)
    draft_every_step: bool = False  # internal (tests, benchmarks): verify draft-model drafts every decode step
    # internal until a GPU check has passed: the triton backend's split-K decode, off | auto | on
    # (jobrunner/attention/split_decode.py; the GPU check's extra phase runs the A/B)
    split_decode: str = "off"
    # internal until a GPU check has passed: sampled ids read one step late, off | cuda | always (always: on the
    # CPU too, for tests; engine/readback.py, docs/engine.md "One-step-late readback")
    late_readback: str = "off"
    # with late_readback: read the last step first whenever a request waits to be admitted, so admission (and the
    # prefix-cache hits it finds) is the synchronous path's exactly; overlap then only once all are admitted
    late_readback_strict: bool = False

    def __post_init__(self) -> None:
        check_speculative(self.speculative, self.num_speculative_tokens)
        check_settings(self)  # bounds and choices as declared above (the job spec checks the same)
        if self.split_decode not in SPLIT_DECODE_MODES:
            raise ValueError(f"EngineConfig.split_decode must be {'|'.join(SPLIT_DECODE_MODES)}, "
                             f"got {self.split_decode!r}")
        if self.late_readback not in LATE_READBACK_MODES:
            raise ValueError(f"EngineConfig.late_readback must be {'|'.join(LATE_READBACK_MODES)}, "
                             f"got {self.late_readback!r}")
        if not 0.0 < self.gpu_share <= 1.0:
            raise ValueError(f"EngineConfig.gpu_share must be in (0, 1], got {self.gpu_share!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"EngineConfig.dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}")
        if self.use_cuda_graphs not in (True, False, "auto"):
            raise ValueError(f"EngineConfig.use_cuda_graphs must be true|false|auto, got {self.use_cuda_graphs!r}")

    def graphs_on(self, device_type: str, backend: str = "jobrunner") -> bool:
        """Whether steps replay CUDA graphs on ``device_type`` for ``backend`` (``jobrunner`` or ``vllm``).

        Never off CUDA. ``auto``: on for vLLM (its graphs and compile are its tested GPU path), off for our
        engine, whose graph paths stay opt-in until ``scripts/gpu_check.sh`` has passed on a GPU."""
        if device_type != "cuda":
            return False
        if self.use_cuda_graphs == "auto":
            return backend == "vllm"
        return bool(self.use_cuda_graphs)

    @classmethod
    def from_dict(cls, values: dict) -> EngineConfig:
        """Build from a plain dict, naming any unknown key."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown engine setting(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)


SPECULATIVE_MODES = ("off", "auto", "ngram")
SPLIT_DECODE_MODES = ("off", "auto", "on")  # as jobrunner.attention.split_decode.SPLIT_MODES (no torch here)
LATE_READBACK_MODES = ("off", "cuda", "always")


def is_draft_source(mode: str) -> bool:
    """Whether ``EngineConfig.speculative`` names a draft model (anything but off / auto / ngram)."""
    return mode not in SPECULATIVE_MODES


def check_speculative(mode: str, num_tokens: int) -> None:
    """ValueError naming the field: ``speculative`` must be a mode or a (non-blank) draft model source."""
    if not isinstance(mode, str) or not mode.strip() or mode != mode.strip():
        raise ValueError(f"speculative must be one of {'|'.join(SPECULATIVE_MODES)} or a draft model source "
                         f"(alias, local dir, Hub id, storage URL) without surrounding blanks, got {mode!r}")
    if not 1 <= num_tokens <= 16:
        raise ValueError(f"EngineConfig.num_speculative_tokens must be in 1..16, got {num_tokens}")
