"""The job spec: pydantic models of a job YAML file, validated once at the start of a job.

Key names are a contract with users and scripts (see docs/driver.md). Every model forbids unknown keys so a
typo fails loudly, naming the field.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

_SECRET_KEY = re.compile(r"(^key$|secret|token|password|passwd|credential|key_id|access_key|session)", re.I)
REDACTED = "***"
ENV_PREFIX = "env:"  # a spec passed in an environment variable (how `submit` ships it)


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(_Spec):
    """Which model the workers load."""

    source: str = Field(
        default="smollm2-135m-instruct",
        description="Model source: the embedded default name, a local directory or a hub id.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="Weight / activation dtype; auto = bfloat16 on GPU; on CPU bfloat16 where it "
        "computes bf16 fast (avx512_bf16 / AMX, confirmed by a short calibration), else float32."
    )
    quantization: Literal["none", "int8", "int4", "fp8"] = Field(
        default="none", description="Quantization applied when loading: int8 / int4 weight-only; fp8 = e4m3 "
        "weights with per-channel scales (W8A8 on CUDA sm89+, dequantized elsewhere). See docs/quantization.md."
    )


class InputSpec(_Spec):
    """Where the prompts come from and how rows become requests."""

    url: str = Field(description="fsspec URL of a Parquet file, a directory of Parquet files or a glob.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec storage options (credentials, endpoint_url, ...)."
    )
    prompt_column: str | None = Field(default=None, description="Column of raw-text prompts (string).")
    messages_column: str | None = Field(
        default=None,
        description="Column of chat messages: a list of {role, content} structs or a JSON string of one.",
    )
    id_column: str | None = Field(
        default=None,
        description="Column of unique row ids; when unset the id is derived as '<file-stem>:<row>'.",
    )
    sampling_column: str | None = Field(
        default=None,
        description="Optional column of per-row sampling overrides (a JSON object string or a struct).",
    )
    rows_per_shard: int = Field(
        default=1000, ge=1, description="About this many rows per shard (and per output part file)."
    )

    @model_validator(mode="after")
    def _one_text_column(self) -> InputSpec:
        if (self.prompt_column is None) == (self.messages_column is None):
            raise ValueError("input: set exactly one of prompt_column or messages_column")
        return self


class SamplingSpec(_Spec):
    """Sampling defaults for every row (per-row overrides come from input.sampling_column)."""

    max_tokens: int = Field(default=128, ge=1, description="Maximum number of generated tokens per row.")
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling probability mass.")
    top_k: int = Field(default=0, ge=0, description="Top-k sampling; 0 = off.")
    seed: int | None = Field(default=None, description="Per-request seed for reproducible sampling.")
    stop: list[str] = Field(default_factory=list, description="Stop strings (removed from the output).")
    stop_token_ids: list[int] = Field(default_factory=list, description="Token ids that stop generation.")
    ignore_eos: bool = Field(default=False, description="Keep generating past the end-of-sequence token.")


class EngineSpec(_Spec):
    """Batching and KV-cache settings of each worker's engine."""

    max_num_seqs: int = Field(default=64, ge=1, description="Most requests decoding at once.")
    max_num_batched_tokens: int = Field(default=2048, ge=1, description="Token budget of one engine step.")
    block_size: int = Field(default=16, ge=1, description="Tokens per KV-cache block.")
    enable_prefix_caching: bool = Field(default=True, description="Reuse KV blocks of shared prefixes.")
    max_model_len: int | None = Field(default=None, ge=1, description="Cap on prompt + output tokens.")
    kv_cache_memory_bytes: int | None = Field(default=None, ge=1, description="KV-cache size on CPU.")
    gpu_memory_utilization: float = Field(
        default=0.85, gt=0.0, le=1.0, description="Fraction of free GPU memory for the KV cache."
    )
    num_kv_blocks: int | None = Field(default=None, ge=1, description="Exact number of KV blocks.")
    device: str = Field(default="auto", description="auto, cpu or cuda.")
    use_cuda_graphs: bool = Field(
        default=True, description="On CUDA, replay decode-only steps from CUDA graphs (ignored on CPU)."
    )
    factory: str | None = Field(
        default=None,
        description="Advanced: 'module:function' called as function(spec) to build the engine "
        "(a custom engine or a test double); default LLMEngine.from_source.",
    )
    factory_options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the custom factory."
    )

    @field_validator("factory")
    @classmethod
    def _factory_form(cls, value: str | None) -> str | None:
        if value is not None and value.count(":") != 1:
            raise ValueError("engine.factory must look like 'package.module:function'")
        return value


class ClusterSpec(_Spec):
    """Where and how many workers run."""

    num_workers: int = Field(default=1, ge=1, description="Number of worker actors (one engine each).")
    num_gpus_per_worker: float = Field(default=0.0, ge=0.0, description="GPUs per worker; 0 = CPU worker.")
    num_cpus_per_worker: float = Field(default=1.0, gt=0.0, description="CPUs reserved per worker.")
    address: str | None = Field(
        default=None, description="Ray address to join (e.g. 'auto', 'ray://head:10001'); unset = local Ray."
    )
    max_shard_attempts: int = Field(default=3, ge=1, description="Attempts per shard before it is failed.")
    retry_backoff_s: float = Field(default=1.0, ge=0.0, description="Delay before a shard's 2nd attempt.")
    max_worker_restarts: int = Field(
        default=3, ge=0, description="Replacement workers started, in total, after worker deaths."
    )


class OutputSpec(_Spec):
    """Where results go."""

    url: str = Field(description="fsspec URL of the output directory.")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="fsspec storage options.")
    mode: Literal["resume", "overwrite", "error"] = Field(
        default="resume",
        description="If the output exists: resume (skip committed shards), overwrite, or error.",
    )
    keep_columns: list[str] = Field(default_factory=list, description="Input columns copied to output rows.")
    rows_per_file: int | None = Field(
        default=None, ge=1, description="Rows per part file; when set it overrides input.rows_per_shard."
    )


class CostSpec(_Spec):
    """Prices used by reports."""

    worker_hour_usd: float = Field(default=0.0, ge=0.0, description="Price of one worker for one hour (USD).")
    slo_ttft_s: float | None = Field(
        default=None, gt=0.0, description="Goodput target: time to first token (s); reports count rows meeting it."
    )
    slo_e2e_s: float | None = Field(
        default=None, gt=0.0, description="Goodput target: end-to-end latency (seconds); reports count rows meeting it."
    )


class JobSpec(_Spec):
    """A whole job."""

    name: str = Field(description="Job name (used in the manifest and reports).", min_length=1)
    model: ModelSpec = Field(default_factory=ModelSpec, description="The model.")
    input: InputSpec = Field(description="The prompt dataset.")
    sampling: SamplingSpec = Field(default_factory=SamplingSpec, description="Sampling defaults.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Engine settings.")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Workers and Ray address.")
    output: OutputSpec = Field(description="Output location and mode.")
    cost: CostSpec = Field(default_factory=CostSpec, description="Cost settings for reports.")

    @property
    def rows_per_shard(self) -> int:
        """Rows per shard (= rows per output part)."""
        return self.output.rows_per_file or self.input.rows_per_shard

    def redacted(self) -> dict[str, Any]:
        """The spec as a plain dict with credential-looking storage options replaced by '***'."""
        data = self.model_dump(mode="json")
        for section in ("input", "output"):
            data[section]["storage_options"] = redact(data[section]["storage_options"])
        return data


class SpecError(ValueError):
    """A job spec that cannot be loaded; the message names the file and field."""


def redact(value: Any) -> Any:
    """Replace values under secret-looking keys, recursively."""
    if isinstance(value, dict):
        return {k: REDACTED if _SECRET_KEY.search(str(k)) else redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def parse_overrides(pairs: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Turn ['a.b=1', 'c=x'] into a nested dict; values are parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise SpecError(f"--set {pair!r}: expected key.path=value")
        node = out
        *parents, leaf = key.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise SpecError(f"--set {pair!r}: {part!r} is set both as a value and a section")
        node[leaf] = yaml.safe_load(raw) if raw.strip() else ""
    return out


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge update into a copy of base."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def spec_from_dict(data: Any, source: str = "<spec>") -> JobSpec:
    """Validate a plain dict; SpecError names the source and every bad field."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: a job spec must be a YAML mapping, got {type(data).__name__}")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(f"{source}: invalid job spec:\n{_format_errors(exc)}") from None


def load_spec(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    """Read a YAML job spec (a file, or 'env:NAME' for an environment variable), apply overrides, validate."""
    if str(path).startswith(ENV_PREFIX):
        name = str(path)[len(ENV_PREFIX):]
        text = os.environ.get(name)
        if text is None:
            raise SpecError(f"env:{name}: environment variable {name} is not set")
        return _from_yaml(text, f"env:{name}", overrides)
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read job spec: {exc.strerror or exc}") from None
    return _from_yaml(text, str(path), overrides)


def _from_yaml(text: str, source: str, overrides: list[str] | tuple[str, ...]) -> JobSpec:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(f"{source}: not valid YAML: {exc}") from None
    if overrides and isinstance(data, dict):
        data = merge(data, parse_overrides(overrides))
    return spec_from_dict(data, source)


def _format_errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = "unknown field (not allowed)" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"  {where}: {msg}")
    return "\n".join(lines)
