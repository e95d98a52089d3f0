"""The job spec: pydantic models of a job YAML file, validated once at the start of a job.

Key names are a contract with users and scripts (see docs/driver.md). Every model forbids unknown keys so a
typo fails loudly, naming the field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from jobrunner.engine.config import EngineConfig, check_speculative
from jobrunner.engine.sampling_params import SamplingParams
from jobrunner.redaction import (
    ENV_REF,
    env_ref_values,
    find_secrets,
    redact,
    redact_text,
    remember_secrets,
    secret_values,
)
from jobrunner.spec_errors import describe_spec_errors
from jobrunner.spec_images import ImageSettings
from jobrunner.spec_sections import section_fields
from jobrunner.url_templates import fill_spec_urls, template_values

ENV_PREFIX = "env:"  # a spec passed in an environment variable (how `submit` ships it)
# Sections that hold what the user generates, never credentials: a JSON schema with a `password` property or
# a stop string `token:` must stay as written (and must not stop `submit`).
USER_DATA_SECTIONS = ("sampling",)
PROGRESS_POLL_S = 1.0  # how often the driver polls a worker's progress (driver/pool.py)
MIN_PROGRESS_POLLS = 3  # progress_timeout_s must span this many polls: one late reply is not a dead worker


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
        "has bf16 GEMM hardware (AMX / avx512_bf16), else float32 -- from the CPU capability, never a timing."
    )
    quantization: Literal["none", "int8", "int8_weight_only", "int4", "fp8", "w8a8"] = Field(
        default="none", description="Quantization applied when loading: int8 = int8 weights, run as w8a8 where "
        "that is faster (CPUs with bf16 activations and VNNI / AMX: per-token int8 activations, about +2% "
        "perplexity on SmolLM2), else weight-only; int8_weight_only = int8 weights only, everywhere; int4 = 4-bit "
        "group-wise weights with lm_head in int8, and above 16 tokens per-token int8 activations through an int8 "
        "GEMM on CPUs with VNNI / AMX (weight-only elsewhere); fp8 = e4m3 weights with per-channel scales (W8A8 "
        "on CUDA sm89+, dequantized elsewhere); w8a8 = int8 weights and per-token int8 activations (CPUs with "
        "VNNI / AMX; int8 weight-only elsewhere). See docs/quantization.md."
    )
    adapters: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters rows can name in input.adapter_column: {name: source}, each a PEFT LoRA adapter "
        "directory (adapter_config.json + adapter_model.safetensors) as a local directory, Hugging Face Hub id or "
        "storage URL, fetched like the model. Rows of different adapters are batched together (docs/engine.md, "
        "LoRA adapters).",
    )

    @field_validator("adapters")
    @classmethod
    def _adapter_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name, source in value.items():
            if not name.strip() or name != name.strip():
                raise ValueError(f"model.adapters: adapter name {name!r} must be non-empty, without surrounding "
                                 "blanks")
            if not isinstance(source, str) or not source.strip():
                raise ValueError(f"model.adapters.{name}: the source must be a non-empty string")
        return value


# input.image_column and the image limits are declared in spec_images.py (issue 49)
_ImageFields = create_model("_ImageFields", __base__=_Spec, __module__=__name__, **section_fields(ImageSettings))


class InputSpec(_ImageFields):
    """Where the prompts come from and how rows become requests."""

    url: str = Field(description="fsspec URL of an input file, a directory of input files or a glob.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec storage options (credentials, endpoint_url, ...)."
    )
    format: Literal["auto", "parquet", "jsonl", "csv", "openai_batch"] = Field(
        default="auto",
        description="Input file format; auto = by extension (.parquet/.parq, .jsonl/.ndjson/.json, .csv). "
        "openai_batch: OpenAI batch request lines (custom_id, method, url, body); set no column names.",
    )
    openai_model_mismatch: Literal["error", "warn"] = Field(
        default="error",
        description="format openai_batch: what to do with a request line whose body.model is not the job's "
        "model (model.source, or its last path part): error (the line is an error row, and validate refuses the "
        "file) or warn (served by the job's model; validate names the lines, the result line's `model` says "
        "which model answered). A line without body.model is always served.",
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
    adapter_column: str | None = Field(
        default=None,
        description="Optional column naming each row's LoRA adapter (a key of model.adapters); null or empty "
        "runs the base model. A name not in model.adapters makes that row an error row.",
    )
    rows_per_shard: int = Field(
        default=1000, ge=1, description="About this many rows per shard (and per output part file)."
    )
    prefix_grouping: Literal["auto", "off"] = Field(
        default="auto",
        description="auto: rows sharing a prompt prefix are grouped into the same shards, shards of one prefix "
        "go to one worker, and a worker admits them together (prefix-cache hits); files whose own order already "
        "keeps shared prefixes together keep their plain row-range shards. off: plain row-range shards.",
    )
    prefix_chars: int = Field(
        default=4096, ge=64,
        description="Characters of a prompt's text (chat messages as role and content, no template) the "
        "planner groups rows by (hashed at 1/64, 1/16, 1/4 and all of it, so shorter shared prefixes group too).",
    )
    prefix_column: str | None = Field(
        default=None, description="Group rows by this column's value instead of the prompt's prefix.")
    limit: int | None = Field(
        default=None, ge=1,
        description="Use only the first N rows (files in sorted order, rows in file order): a smoke run. "
        "Recorded in the manifest's spec, so a later run without it is a different run.",
    )

    system_prompt: str | None = Field(
        default=None,
        description="A system message shared by every row, put before the row's messages (a row whose messages "
        "already start with a system message keeps its own). With prompt_column each row becomes a chat of "
        "two messages (system, then the prompt as the user's), so the model's chat template applies.",
    )
    system_prompt_column: str | None = Field(
        default=None,
        description="Optional column of per-row system prompts (string); a null or empty value takes "
        "system_prompt (or none).",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra variables for the chat template (e.g. {enable_thinking: false} for Qwen3).",
    )
    chat_template_kwargs_column: str | None = Field(
        default=None,
        description="Optional column of per-row chat-template variables (a JSON object string or a struct), "
        "merged over chat_template_kwargs (e.g. {enable_thinking: false} on some rows only).",
    )
    chat_template: str | None = Field(
        default=None, description="A Jinja chat template used instead of the tokenizer's own."
    )
    tools: list[dict[str, Any]] | None = Field(
        default=None,
        description="Tools (OpenAI form: {type: function, function: {name, description, parameters}}) given to "
        "every chat row's template; the model's calls come back parsed in `tool_calls` (output.tool_call_parser).",
    )
    tools_column: str | None = Field(
        default=None, description="Optional column of per-row tools (a JSON array string or a list of structs), "
        "instead of `tools` for that row.",
    )
    tool_choice: Any = Field(
        default=None,
        description="auto (default: the model decides), none, required (a call is forced through structured "
        "output), or {type: function, function: {name}} (that function is forced).",
    )
    completion_column: str | None = Field(
        default=None,
        description="task score: column of completions (string) whose log-likelihood given the row's prompt is "
        "scored (teacher forcing); unset: the model's sequence-classification head scores the prompt.",
    )

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_form(cls, value: Any) -> Any:
        named = isinstance(value, dict) and isinstance(value.get("function"), dict) and \
            isinstance(value["function"].get("name"), str)
        if value not in (None, "auto", "none", "required") and not named:
            raise ValueError("input.tool_choice must be auto, none, required or {type: function, function: {name}}")
        return value

    @field_validator("prefix_grouping", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        """YAML reads a bare ``off`` as false: ``input.prefix_grouping: off`` means the mode ``off``."""
        return "off" if value is False else value

    @model_validator(mode="after")
    def _one_text_column(self) -> InputSpec:
        if self.format == "openai_batch":
            named = [k for k in _OPENAI_BATCH_UNSET if getattr(self, k) is not None]
            if named:
                raise ValueError(f"input.format openai_batch takes the id (custom_id), the prompt and the "
                                 f"sampling from each request line; unset {', '.join(named)}")
            return self
        if (self.prompt_column is None) == (self.messages_column is None):
            raise ValueError("input: set exactly one of prompt_column or messages_column")
        return self


_OPENAI_BATCH_UNSET = ("prompt_column", "messages_column", "id_column", "sampling_column", "adapter_column",
                       "image_column", "system_prompt", "system_prompt_column", "chat_template_kwargs_column", "tools",
                       "tools_column", "tool_choice")


# The sampling and engine keys, their types, bounds and descriptions are the engine's own fields (declared once,
# in engine/sampling_params.py and engine/config.py with `setting(...)`); a job's sampling defaults differ here.
JOB_SAMPLING_DEFAULTS = {"max_tokens": 128, "temperature": 0.0}
_SamplingFields = create_model("_SamplingFields", __base__=_Spec, __module__=__name__,
                               **section_fields(SamplingParams, JOB_SAMPLING_DEFAULTS))
_EngineFields = create_model("_EngineFields", __base__=_Spec, __module__=__name__, **section_fields(EngineConfig))


class SamplingSpec(_SamplingFields):
    """Sampling defaults for every row (per-row overrides come from input.sampling_column)."""

    seed_per_row: bool | None = Field(
        default=None,
        description="With sampling.seed: each row samples with its own seed, a hash of sampling.seed and the "
        "row's id, so identical prompts in different rows give different samples while a row gets the same seed "
        "on every retry and resume (unset = true); false: every row uses sampling.seed itself (identical prompts, "
        "identical samples). A seed a row asks for itself (input.sampling_column, an OpenAI batch line) is kept.",
    )
    seed_column: str | None = Field(
        default=None,
        description="An input column of per-row integer seeds (0..2**63-1), used as written; a null takes the "
        "job's rule (sampling.seed, per row). Part of each row's request fingerprint.",
    )

    def engine_values(self) -> dict[str, Any]:
        """The settings the engine takes (SamplingParams), without the driver's row-seed rules."""
        return self.model_dump(exclude={"seed_per_row", "seed_column"})

    @field_validator("logprobs", "prompt_logprobs", mode="before")
    @classmethod
    def _flag_is_no_alternatives(cls, value: Any) -> Any:
        """``logprobs: true`` is OpenAI's chat flag: each token's own logprob, no alternatives (K = 0, as the
        engine and an OpenAI batch line read it), never pydantic's int(True) = 1; false is off."""
        return 0 if value is True else None if value is False else value

    @model_validator(mode="after")
    def _engine_accepts(self) -> SamplingSpec:
        """The engine's own checks of the whole section, the one place they are written (at most one of
        json_schema / regex / choice, a json_schema that parses to an object, min_tokens within max_tokens, ...):
        a bad section fails here, before any worker starts, with the engine's message naming the field."""
        SamplingParams.from_dict(self.engine_values())
        return self


class EndpointSpec(_Spec):
    """engine.backend openai: an OpenAI-compatible endpoint as each worker's engine (docs/endpoints.md)."""

    base_url: str = Field(description="The endpoint's base URL, up to and including /v1 "
                          "(e.g. http://127.0.0.1:8000/v1).", min_length=1)
    model: str = Field(description="The model name the endpoint serves (the request body's model).", min_length=1)
    api_key: str | None = Field(
        default=None, description="Sent as 'Authorization: Bearer ...': write ${env:NAME} (never the key itself); "
        "unset: $OPENAI_API_KEY if set, else no header. Never written to the manifest, logs or errors.")
    max_concurrency: int = Field(default=16, ge=1, le=1024,
                                 description="Requests in flight at once, per worker.")
    requests_per_minute: float | None = Field(
        default=None, gt=0.0, description="Most requests sent in any 60 s, per worker (a 429 the server "
        "answers is given back); unset: no limit.")
    tokens_per_minute: float | None = Field(
        default=None, gt=0.0, description="Most tokens (prompt + max_tokens as estimated at send, corrected by the "
        "usage the server reports) in any 60 s, per worker; unset: no limit.")
    max_retries: int = Field(default=6, ge=0, le=100,
                             description="Retries of a request answered 429 / 5xx, dropped or timed out; then "
                             "the row is an error row naming the status.")
    timeout_s: float = Field(default=600.0, gt=0.0, description="Most time one request may take.")
    stream: bool = Field(default=False, description="Stream each answer (server-sent events, the usage asked with "
                         "stream_options): rows then get their time to first token (ttft_s).")
    tokenizer: str | None = Field(
        default=None, description="A tokenizer to estimate prompt tokens with (a local model directory or "
        "alias already on this machine); unset: model.source's when it is on this machine, else characters / 4.")

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"engine.endpoint.base_url {value!r} must start with http:// or https://")
        return value.rstrip("/")


class EngineSpec(_EngineFields):
    """Batching and KV-cache settings of each worker's engine (and a custom engine factory)."""

    factory: str | None = Field(
        default=None,
        description="Advanced: 'module:function' called as function(spec) to build the engine "
        "(a custom engine or a test double); default LLMEngine.from_source.",
    )
    factory_options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the custom factory."
    )
    backend: Literal["jobrunner", "vllm", "openai"] = Field(
        default="jobrunner",
        description="The engine each worker runs: jobrunner (ours), vllm (vLLM's engine in its own process, "
        "from the Python engine.vllm_python names) or openai (an OpenAI-compatible endpoint, engine.endpoint).",
    )
    endpoint: EndpointSpec | None = Field(
        default=None, description="backend openai: the endpoint, its limits and retries (docs/endpoints.md).")
    vllm_python: str | None = Field(
        default=None, description="backend vllm: the Python that has vLLM (default $JOBRUNNER_VLLM_PYTHON, else "
        "the worker's own)."
    )
    vllm_options: dict[str, Any] = Field(
        default_factory=dict,
        description="backend vllm: vLLM engine arguments no jobrunner setting covers (e.g. tensor_parallel_size), "
        "checked against vLLM's own names by validate.",
    )

    @field_validator("speculative", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        """YAML reads a bare ``off`` as false: ``engine.speculative: off`` means the mode ``off``."""
        return "off" if value is False else value

    @field_validator("speculative")
    @classmethod
    def _speculative_form(cls, value: str) -> str:
        """off | auto | ngram, or a draft model source (checked like model.source by validate / run)."""
        check_speculative(value, 1)
        return value

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
    gpu: str | None = Field(
        default=None, description="The workers' GPU, for validate's fit check (weights, activations and the KV "
        "cache that fits): a name (L4, A10G, L40S, A100-40GB, A100-80GB, H100, H200) or its memory ('24GB', "
        "'80GiB'); unset: the fit is not checked (docs/driver.md).")
    num_cpus_per_worker: float = Field(default=1.0, gt=0.0, description="CPUs reserved per worker.")
    worker_niceness: int = Field(
        default=0, ge=0, le=19,
        description="Scheduling niceness (Linux nice, 0-19) of the worker processes. Ray starts task and actor "
        "workers at 15; a worker at 15 gets about 1/30 of a core beside each busy process of normal "
        "priority on its node, so a shared or loaded node starves inference. 0 (the default) runs workers at "
        "normal priority; raise it to let other work on shared nodes go first.",
    )
    address: str | None = Field(
        default=None, description="Ray address to join (e.g. 'auto', 'ray://head:10001'); unset = local Ray."
    )
    max_shard_attempts: int = Field(default=3, ge=1, description="Attempts per shard before it is failed.")
    retry_backoff_s: float = Field(default=1.0, ge=0.0, description="Delay before a shard's 2nd attempt.")
    max_worker_restarts: int = Field(
        default=10, ge=0,
        description="Replacement workers started per worker_restart_window_s (a rate, not a job total).",
    )
    worker_restart_window_s: float = Field(
        default=600.0, gt=0.0, description="Window over which max_worker_restarts is counted."
    )
    worker_start_timeout_s: float = Field(
        default=1800.0, gt=0.0,
        description="Most time for the first worker to be placed and load its model; the job then fails "
        "naming the resources the cluster could not give.",
    )
    progress_timeout_s: float = Field(
        default=600.0, gt=0.0,
        description="A worker holding rows with no token produced and no row finished for this long rebuilds "
        "its engine and isolates the rows in-process (an engine call that never returns: the worker is "
        "replaced and its shards retried).",
    )
    job_stall_timeout_s: float = Field(
        default=1800.0, gt=0.0,
        description="Most time the whole job may go without an event (a shard result, a worker placed or "
        "ready, a commit, progress reported by a worker); then it ends with an error naming what it waited "
        "for. At least progress_timeout_s.",
    )
    io_timeout_s: float = Field(
        default=600.0, gt=0.0,
        description="Most time a worker waits for reading a shard's input or writing its part; then the "
        "attempt fails naming the shard and phase (charged, retried with backoff).",
    )
    max_engine_rebuilds_per_shard: int = Field(
        default=100, ge=0,
        description="In-process engine rebuilds a shard may cause while its crashing rows are isolated; then "
        "its remaining suspect rows become error rows.",
    )
    max_isolation_restarts_per_shard: int = Field(
        default=8, ge=0,
        description="Worker restarts (process deaths, hung engine calls) a shard may cause while its rows are "
        "isolated; then its remaining suspect rows become error rows.",
    )
    max_isolation_restarts: int = Field(
        default=32, ge=0, description="The same over the whole job (all shards together).",
    )

    @field_validator("progress_timeout_s")
    @classmethod
    def _progress_timeout_floor(cls, value: float) -> float:
        """A worker is polled every PROGRESS_POLL_S: a deadline of fewer polls calls healthy workers dead."""
        floor = MIN_PROGRESS_POLLS * PROGRESS_POLL_S
        if value < floor:
            raise ValueError(f"cluster.progress_timeout_s={value:g} is below {floor:g} s ({MIN_PROGRESS_POLLS} "
                             f"progress polls, one every {PROGRESS_POLL_S:g} s): healthy workers would be "
                             "replaced as silent")
        return value

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, value: str | None) -> str | None:
        if value is not None:
            from jobrunner.gpus import gpu_memory_bytes

            gpu_memory_bytes(value)  # ValueError naming the known GPUs
        return value

    @model_validator(mode="after")
    def _stall_after_progress(self) -> ClusterSpec:
        if self.job_stall_timeout_s < self.progress_timeout_s:
            raise ValueError(f"cluster.job_stall_timeout_s={self.job_stall_timeout_s:g} is below "
                             f"cluster.progress_timeout_s={self.progress_timeout_s:g}: a hung worker would end the "
                             "job before it is replaced")
        return self


class OutputSpec(_Spec):
    """Where results go."""

    url: str = Field(description="fsspec URL of the output directory.")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="fsspec storage options.")
    mode: Literal["resume", "overwrite", "error", "incremental"] = Field(
        default="resume",
        description="If the output exists: resume (skip committed shards), overwrite, or error. incremental: "
        "for inputs that grow, run only the rows whose ids have no committed output row here (or in "
        "output.skip_done_from) and commit them as a new run of this output.",
    )
    skip_done_from: list[str] = Field(
        default_factory=list,
        description="With mode incremental: earlier outputs (URLs, or globs of output URLs such as "
        "s3://bucket/nightly/*) whose committed ids are skipped too; read with output.storage_options.",
    )
    check_done_prompts: bool = Field(
        default=True,
        description="With mode incremental: read the request columns of the rows whose ids are done and report "
        "those whose request changed since (they are skipped all the same); false reads only the id column.",
    )
    keep_columns: list[str] | Literal["*"] = Field(
        default_factory=list, description="Input columns copied to output rows; '*' = every input column."
    )
    dedupe: Literal["none", "prompts", "outputs"] = Field(
        default="none",
        description="prompts: a row whose request (prompt or messages, per-row sampling, system prompt, tools: "
        "its request fingerprint) repeats an earlier row's (files in order, rows in order) is not generated; it "
        "is written as a row of its own with finish_reason 'duplicate' and dedupe_of = the first row's id (every "
        "id still comes out once; the counts are in the manifest's dedupe and the report). outputs: every row "
        "is generated and carries output_fingerprint (a hash of its text); when the last shard commits, the "
        "samples whose text a smaller (id, sample_index) already has are listed in _plan/dedupe-outputs.parquet "
        "and counted in the manifest's dedupe. none: neither.",
    )
    format: Literal["parquet", "messages"] = Field(
        default="parquet",
        description="parquet: the output rows; messages: also a `messages` column, the input chat with the "
        "assistant turn appended (ready for fine-tuning).",
    )
    reasoning_parser: Literal["auto", "none", "think_tags", "harmony"] = Field(
        default="auto",
        description="Reasoning traces apart from answers: generated_text holds the answer, `reasoning` the "
        "trace, `num_reasoning_tokens` its tokens. think_tags: <think>...</think> (Qwen3, DeepSeek-R1); "
        "harmony: gpt-oss channels; auto: from the model's chat template (none when it has neither); none: "
        "the whole text in generated_text and no reasoning columns.",
    )
    tool_call_parser: Literal["auto", "none", "hermes", "llama3_json"] = Field(
        default="auto",
        description="How tool calls are read from rows that carry tools: hermes (<tool_call>{json}</tool_call>: "
        "Qwen, Hermes), llama3_json (a JSON call: Llama 3.1+), auto (from the chat template), none (kept as text).",
    )
    rows_per_file: int | None = Field(
        default=None, ge=1, description="Rows per part file; when set it overrides input.rows_per_shard."
    )
    max_error_rate: float = Field(
        default=0.1, ge=0.0, le=1.0,
        description="Largest share of error rows for a successful job; above it the job exits non-zero "
        "(a job where every row errors always does).",
    )
    lease_ttl_s: float = Field(
        default=120.0, ge=5.0,
        description="Lifetime of the output's lease without a heartbeat; a crashed run's lease is taken "
        "over after it.",
    )

    @model_validator(mode="after")
    def _skip_done_from_incremental(self) -> OutputSpec:
        if self.skip_done_from and self.mode != "incremental":
            raise ValueError(f"output.skip_done_from is set but output.mode is {self.mode!r}: only an incremental "
                             "run skips the ids of other outputs; set output.mode: incremental")
        return self


class CostSpec(_Spec):
    """Prices used by reports."""

    worker_hour_usd: float = Field(default=0.0, ge=0.0, description="Price of one worker for one hour (USD).")
    usd_per_m_input: float | None = Field(
        default=None, ge=0.0, description="Price of one million prompt tokens (USD): an endpoint's token price; "
        "reports show the token-priced cost beside the worker-hour one.")
    usd_per_m_output: float | None = Field(
        default=None, ge=0.0, description="Price of one million output tokens (USD).")
    max_usd: float | None = Field(
        default=None, gt=0.0, description="engine.backend openai: most a run may spend at the token prices; once "
        "reached no request is sent, the ones in flight finish and the run stops, resumable (docs/endpoints.md).")
    slo_ttft_s: float | None = Field(
        default=None, gt=0.0, description="Goodput target: time to first token (s); reports count rows meeting it."
    )
    slo_e2e_s: float | None = Field(
        default=None, gt=0.0, description="Goodput target: end-to-end latency (seconds); reports count rows meeting it."
    )


class EmbedSpec(_Spec):
    """How an embed job pools a prompt's hidden states into one vector."""

    pooling: Literal["auto", "last", "mean", "cls"] = Field(
        default="auto", description="auto = as the model directory says (sentence-transformers modules.json and "
        "1_Pooling/config.json), else the last token (decoder models); last | mean | cls force one.")
    normalize: bool | Literal["auto"] = Field(
        default="auto", description="L2-normalise the embedding; auto = when the model's modules.json has a "
        "Normalize module.")


class StageInputSpec(_Spec):
    """How a pipeline stage builds its requests from the previous stage's columns (docs/driver.md, Pipelines)."""

    prompt: str | None = Field(default=None, description="A prompt template over the previous stage's columns: "
                               "{column} is a column's value, {{ and }} are braces.")
    messages: list[dict[str, str]] | None = Field(
        default=None, description="Messages ({role, content} with content a template) appended to the previous "
        "stage's conversation (its prompt or messages, then its reply).")
    completion: str | None = Field(default=None, description="task score: a template of the completion to score "
                                   "after the prompt (log-likelihood).")

    @model_validator(mode="after")
    def _one_form(self) -> StageInputSpec:
        from jobrunner.pipeline.template import parse_template

        if (self.prompt is None) == (self.messages is None):
            raise ValueError("set one of prompt (a template) or messages (appended to the conversation)")
        for i, message in enumerate(self.messages or []):
            if set(message) != {"role", "content"}:
                raise ValueError(f"messages[{i}]: needs exactly role and content")
            parse_template(message["content"], f"messages[{i}].content")
        for name in ("prompt", "completion"):
            if getattr(self, name) is not None:
                parse_template(getattr(self, name), name)
        return self


class StageSpec(_Spec):
    """One stage of a pipeline (docs/driver.md, Pipelines): a job over the previous stage's rows."""

    name: str = Field(description="The stage's name (its folder under output.url/stages/).",
                      pattern=r"^[a-z_][a-z0-9_]*$", max_length=64)
    task: Literal["generate", "embed", "score"] | None = Field(default=None, description="The stage's task "
                                                               "(unset: the job's).")
    model: dict[str, Any] = Field(default_factory=dict, description="Merged over the job's model section.")
    engine: dict[str, Any] = Field(default_factory=dict, description="Merged over the job's engine section.")
    sampling: dict[str, Any] = Field(default_factory=dict, description="Merged over the job's sampling section.")
    embed: dict[str, Any] = Field(default_factory=dict, description="Merged over the job's embed section.")
    cluster: dict[str, Any] = Field(default_factory=dict, description="Merged over the job's cluster section "
                                    "(each stage has its own workers).")
    cost: dict[str, Any] = Field(default_factory=dict, description="Merged over the job's cost section (an "
                                 "endpoint stage's token prices).")
    input: StageInputSpec | None = Field(default=None, description="Every stage but the first: the request built "
                                         "from the previous stage's columns.")
    output_columns: dict[str, str] = Field(
        default_factory=dict, description="Columns computed from this stage's rows when handed on: "
        "'json.<key>' reads the first JSON object in generated_text (json_valid is added).")
    filter: str | None = Field(default=None, description="Which rows go on: an expression over the stage's "
                               "columns (json_valid and score >= 7).")

    @model_validator(mode="after")
    def _parses(self) -> StageSpec:
        from jobrunner.pipeline.expr import parse_filter
        from jobrunner.pipeline.handoff import parse_output_column

        if self.filter is not None:
            parse_filter(self.filter)
        for column, source in self.output_columns.items():
            parse_output_column(column, source)
        return self


# What a generation-only setting would silently not do in an embed / score job: refused instead.
_GENERATE_ONLY = {"input.sampling_column": lambda s: s.input.sampling_column,
                  "input.tools": lambda s: s.input.tools, "input.tools_column": lambda s: s.input.tools_column,
                  "input.tool_choice": lambda s: s.input.tool_choice,
                  "output.format: messages": lambda s: s.output.format == "messages",
                  "sampling.n > 1": lambda s: s.sampling.n > 1}


class JobSpec(_Spec):
    """A whole job."""

    name: str = Field(description="Job name (used in the manifest and reports).", min_length=1)
    task: Literal["generate", "embed", "score"] = Field(
        default="generate", description="generate: text (the default); embed: one vector per row (an `embedding` "
        "column; see `embed`); score: a sequence-classification / reward head's `scores` per row, or with "
        "input.completion_column the log-likelihood of each row's completion. embed and score rows are "
        "prefill-only (no output tokens).")
    embed: EmbedSpec = Field(default_factory=EmbedSpec, description="Pooling of an embed job.")
    model: ModelSpec = Field(default_factory=ModelSpec, description="The model.")
    input: InputSpec = Field(description="The prompt dataset.")
    sampling: SamplingSpec = Field(default_factory=SamplingSpec, description="Sampling defaults.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Engine settings.")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Workers and Ray address.")
    output: OutputSpec = Field(description="Output location and mode.")
    cost: CostSpec = Field(default_factory=CostSpec, description="Cost settings for reports.")
    stages: list[StageSpec] = Field(default_factory=list, description="A pipeline: stages run over the same "
                                    "rows, each a job under output.url/stages/<name>/ (docs/driver.md, Pipelines).")
    _logical_date: str | None = PrivateAttr(default=None)  # the {date} this spec's URLs were filled with

    @property
    def logical_date(self) -> str:
        """The night this run belongs to: the `{date}` its URLs were filled with when it was loaded
        (`$JOBRUNNER_DATE`, else the UTC date then); the manifest records it and trends are keyed by it."""
        return self._logical_date or template_values()["date"]

    @model_validator(mode="after")
    def _task_settings(self) -> JobSpec:
        if self.input.completion_column is not None and self.task != "score":
            raise ValueError("input.completion_column is scored by task: score; set task: score or unset it")
        if self.task == "generate":
            return self
        named = [name for name, value in _GENERATE_ONLY.items() if value(self)]
        if named:
            raise ValueError(f"task {self.task} generates no text: {', '.join(named)} do not apply; unset them")
        if self.input.format == "openai_batch" and self.task != "embed":
            raise ValueError("input.format openai_batch runs task generate (/v1/chat/completions, /v1/completions) "
                             "or task embed (/v1/embeddings); task score reads prompt and completion columns")
        return self

    @model_validator(mode="after")
    def _adapters_fit(self) -> JobSpec:
        if self.input.adapter_column and not self.model.adapters:
            raise ValueError("input.adapter_column names each row's adapter: set model.adapters ({name: source})")
        if self.model.adapters and self.engine.deterministic:
            raise ValueError("engine.deterministic is not supported with model.adapters (docs/engine.md, LoRA "
                             "adapters)")
        if self.model.adapters and self.engine.factory is None and self.engine.use_cuda_graphs is True:
            raise ValueError("engine.use_cuda_graphs is not supported with model.adapters (docs/engine.md, LoRA "
                             "adapters)")
        return self

    @model_validator(mode="after")
    def _seed_column_fits(self) -> JobSpec:
        if self.sampling.seed_column and self.input.format == "openai_batch":
            raise ValueError("sampling.seed_column does not apply to input.format openai_batch: a request line "
                             "carries its own seed in its body")
        return self

    @model_validator(mode="after")
    def _backend_fits(self) -> JobSpec:
        """engine.backend vllm: every setting that has no vLLM equivalent is refused here, by name."""
        if self.engine.backend == "vllm":
            from jobrunner.vllm_backend.mapping import unmapped_settings

            problems = unmapped_settings(self)
            if problems:
                raise ValueError("engine.backend vllm: " + "; ".join(problems))
        elif self.engine.vllm_options:  # engine.vllm_python may stay: `--set engine.backend=vllm` then uses it
            raise ValueError("engine.vllm_options apply to engine.backend vllm only")
        self._endpoint_fits()
        from jobrunner.spec_parallel import parallel_problem

        problem = parallel_problem(self)  # GPUs = tensor x pipeline ranks, pipeline on vLLM only, a core per rank
        if problem:
            raise ValueError(problem)
        return self

    def _endpoint_fits(self) -> None:
        """engine.backend openai: an endpoint named, a generate job, no settings only a local engine has."""
        from jobrunner.endpoint_backend.fit import endpoint_problems

        problems = endpoint_problems(self)
        if problems:
            raise ValueError("; ".join(problems))

    @model_validator(mode="after")
    def _stages_fit(self) -> JobSpec:
        """Stage names unique, the first stage reads the job's input, every later one builds its own, and each
        stage's own job spec (stage_specs) is valid, errors naming the stage."""
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stages: names must be unique, got {names}")
        for i, stage in enumerate(self.stages):
            if (stage.input is None) != (i == 0):
                raise ValueError(f"stages[{i}] ({stage.name}): " + (
                    "the first stage reads the job's input; leave its input unset" if i == 0 else
                    "set input.prompt or input.messages (built from the previous stage's columns)"))
        if self.stages:
            for i, spec in enumerate(self.stage_specs()[:-1]):
                if spec.sampling.n > 1:  # n rows of one id would reach the next stage as one id n times
                    raise ValueError(f"stages[{i}] ({self.stages[i].name}): sampling.n > 1 gives several rows per "
                                     "id; only the last stage may sample n > 1")
        return self

    def stage_specs(self) -> list[JobSpec]:
        """Each stage's own job spec (jobrunner/pipeline/stage_specs.py); ValueError naming the stage."""
        from jobrunner.pipeline.stage_specs import stage_dicts

        job = self.model_dump(exclude_unset=True, exclude={"stages"})
        for name in ("input", "output"):
            job[name] = getattr(self, name).model_dump(exclude_unset=True)
        stages = [s.model_dump(exclude_unset=True) for s in self.stages]
        out = []
        for i, data in enumerate(stage_dicts(job, stages)):
            try:
                spec = JobSpec.model_validate(data)
            except ValidationError as exc:
                problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:3])
                raise ValueError(f"stages[{i}] ({self.stages[i].name}): {problems}") from None
            spec._logical_date = self._logical_date
            out.append(spec)
        return out

    @property
    def rows_per_shard(self) -> int:
        """Rows per shard (= rows per output part)."""
        return self.output.rows_per_file or self.input.rows_per_shard

    def redacted(self) -> dict[str, Any]:
        """The spec as a plain dict, secrets replaced by '***' at every depth (jobrunner.redaction.redact):
        credential-named keys anywhere (storage_options, engine.factory_options, headers, ...) and
        credentials inside strings (URL passwords, signed query strings); USER_DATA_SECTIONS are kept."""
        data = self.model_dump(mode="json")
        return {k: v if k in USER_DATA_SECTIONS else redact(v) for k, v in data.items()}

    def secret_values(self) -> set[str]:
        """The secret values this spec holds (credential-named options, URL passwords, tokens: outside
        USER_DATA_SECTIONS), to be cut by value from every text (jobrunner.redaction.secret_values)."""
        data = self.model_dump(mode="json")
        return secret_values({k: v for k, v in data.items() if k not in USER_DATA_SECTIONS})


class SpecError(ValueError):
    """A job spec that cannot be loaded; the message names the file and field."""


def plain_text_secrets(data: Any) -> list[str]:
    """Dotted paths of secrets written out in a spec dict (not `${env:NAME}`); `submit` refuses those."""
    if not isinstance(data, dict):
        return []
    return find_secrets({k: v for k, v in data.items() if k not in USER_DATA_SECTIONS})


def resolve_env_refs(value: Any, source: str = "<spec>", path: str = "") -> Any:
    """A copy of `value` with every `${env:NAME}` in its strings replaced by $NAME of this process.

    SpecError names the field and the variable when one is not set. This runs where the spec is loaded to
    run (on a cluster: the head), so a submitted spec carries the reference, never the secret.
    """
    if isinstance(value, dict):
        return {k: resolve_env_refs(v, source, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_env_refs(v, source, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, str) and "${env:" in value:
        return ENV_REF.sub(lambda m: _env_value(m.group(1), source, path), value)
    return value


def _env_value(name: str, source: str, path: str) -> str:
    value = os.environ.get(name)
    if value is None:
        raise SpecError(f"{source}: {path}: environment variable {name} (from ${{env:{name}}}) is not set "
                        "in this process; set it where the job runs (see docs/driver.md, Secrets)")
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
                raise SpecError(redact_text(f"--set {pair!r}: {part!r} is set both as a value and a section"))
        node[leaf] = _override_value(pair, raw)
    return out


def _override_value(pair: str, raw: str) -> Any:
    """A `--set` value parsed as YAML; SpecError in one line naming the `--set` when it is not YAML."""
    if not raw.strip():
        return ""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(redact_text(f"--set {pair!r}: the value is not valid YAML ({problem}); write a list as "
                                    "[a, b], a mapping as {k: v}, and put text that is not YAML in quotes")) from None


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge update into a copy of base."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def spec_from_dict(data: Any, source: str = "<spec>", overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    """Validate a plain dict; SpecError names the source (the file, or the `--set` that set a bad field) and
    every bad field, with a "did you mean" for misspelt keys."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: a job spec must be a YAML mapping, got {type(data).__name__}")
    try:
        values = template_values()  # one set per load: {date}, {datetime}, {run_id} in input.url / output.url
    except ValueError as exc:  # a $JOBRUNNER_DATE that is not YYYY-MM-DD
        raise SpecError(f"{source}: {exc}") from None
    data = fill_spec_urls(data, source, SpecError, values)
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(redact_text(describe_spec_errors(JobSpec, exc, source, overrides))) from None
    spec._logical_date = values["date"]
    return spec


def load_spec(path: str | Path, overrides: list[str] | tuple[str, ...] = (), resolve_env: bool = True) -> JobSpec:
    """Read a YAML job spec (a file, or 'env:NAME' for an environment variable), apply overrides, validate.

    resolve_env: replace `${env:NAME}` references by this process's environment (False keeps them as
    written: `jobrunner submit` validates and ships the spec without the secrets).
    """
    data, source = load_spec_data(path, overrides)
    if resolve_env:
        remember_secrets(secret_values({}, env_ref_values(data)))  # before any error can quote them
        data = resolve_env_refs(data, source)
    spec = spec_from_dict(data, source, overrides)
    remember_secrets(spec.secret_values())  # cut by value from all this process writes or prints
    return spec


def load_spec_data(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[Any, str]:
    """The spec as written (overrides merged, `${env:NAME}` kept) and a name of where it came from."""
    if str(path).startswith(ENV_PREFIX):
        name = str(path)[len(ENV_PREFIX):]
        text = os.environ.get(name)
        if text is None:
            raise SpecError(f"env:{name}: environment variable {name} is not set")
        return _from_yaml(text, f"env:{name}", overrides), f"env:{name}"
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read job spec: {exc.strerror or exc}") from None
    return _from_yaml(text, str(path), overrides), str(path)


def _from_yaml(text: str, source: str, overrides: list[str] | tuple[str, ...]) -> Any:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(redact_text(f"{source}: not valid YAML: {exc}")) from None  # quotes the line
    if overrides and isinstance(data, dict):
        data = merge(data, parse_overrides(overrides))
    return data

