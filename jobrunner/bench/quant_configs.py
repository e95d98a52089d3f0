"""The configs a quantization comparison loads side by side: ``[dtype:]scheme[/overrides][@crossovers]``.

``none,int8,int4`` names schemes on the bench's ``--dtype``; ``float32:none,bfloat16:none,bfloat16:int4`` puts
float dtypes side by side, so a float32 and a bfloat16 control run next to the quantized models (``bf16`` is
short for ``bfloat16:none``). A scheme may carry per-layer overrides (``int4/lm_head=int8``, several joined by
``+``) and crossovers of its own (``bfloat16:int4@int4=8+int4_int8=4096``: ``JOBRUNNER_QUANT_KERNEL_TOKENS``
while that engine loads, ``+`` for ``,``). The dispatch is decided when a model is quantized, so engines loaded
side by side keep their own crossovers. The first config is the reference every other one is compared with:
it must be unquantized.

Every engine here runs with prefix caching and speculation off: with speculation, the tokens a step yields
depend on the text each scheme generates (a scheme that repeats itself gets more n-gram drafts accepted), not
only on its kernels.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from jobrunner.kernels.switches import overridden
from jobrunner.quant.apply import SCHEMES
from jobrunner.quant.choice import INT8_WEIGHT_ONLY
from jobrunner.quant.dispatch import CROSSOVER_ENV

DTYPES = ("auto", "float32", "bfloat16", "float16")
ALIASES = {"bf16": "bfloat16:none"}
CONFIG_SYNTAX = ("a comma-separated list starting with none (or bf16, or DTYPE:none), of [DTYPE:]SCHEME with "
                 "SCHEME none|int8|int8_weight_only|int4|fp8|w8a8|bf16, optional per-layer overrides "
                 "(int4/lm_head=int8) and crossovers (int4@int4=8+int4_int8=4096)")


@dataclass(frozen=True)
class QuantConfig:
    """One engine of a comparison: ``name`` as given (the key of every result), the model's ``dtype``, the
    ``scheme`` and its per-layer ``overrides``, and ``crossovers`` (a ``JOBRUNNER_QUANT_KERNEL_TOKENS`` value,
    empty: the process's own)."""

    name: str
    dtype: str
    scheme: str
    overrides: tuple[tuple[str, str], ...] = ()
    crossovers: str = ""

    @property
    def is_quantized(self) -> bool:
        """Whether this config quantizes any layer (the float configs are the ratios' references)."""
        return self.scheme != "none"


def parse_config(name: str, default_dtype: str = "auto") -> QuantConfig:
    """``[dtype:]scheme[/layer=scheme+...][@scheme=tokens+...]`` as a :class:`QuantConfig`; a bare scheme runs on
    ``default_dtype``. Raises ``ValueError`` naming the part that is wrong."""
    key = name.strip().lower()
    text, _, crossovers = key.partition("@")
    dtype, _, rest = ALIASES.get(text, text).rpartition(":")
    scheme, _, layers = rest.partition("/")
    config = QuantConfig(key, dtype or default_dtype, scheme, _pairs(layers, name), _crossovers(crossovers, name))
    if config.dtype not in DTYPES:
        raise ValueError(f"{name!r}: dtype {config.dtype!r} is not one of {'|'.join(DTYPES)}")
    if config.scheme not in (*SCHEMES, INT8_WEIGHT_ONLY) or any(value not in SCHEMES for _, value in config.overrides):
        raise ValueError(f"{name!r}: unknown scheme; {CONFIG_SYNTAX}")
    return config


def parse_configs(names: Sequence[str], default_dtype: str = "auto") -> list[QuantConfig]:
    """:func:`parse_config` of each name; the first must be unquantized and no name may repeat."""
    configs = [parse_config(n, default_dtype) for n in names]
    if not configs or configs[0].is_quantized:
        raise ValueError(f"{','.join(names)!r}: {CONFIG_SYNTAX}")
    if len({c.name for c in configs}) < len(configs):
        raise ValueError(f"{','.join(names)!r}: a config is named twice")
    return configs


def _pairs(text: str, name: str) -> tuple[tuple[str, str], ...]:
    """``"a=b+c=d"`` as ``(("a", "b"), ("c", "d"))``."""
    items = [item for item in text.split("+") if item]
    if any("=" not in item for item in items):
        raise ValueError(f"{name!r}: per-layer overrides and crossovers are NAME=VALUE joined by '+'")
    return tuple(tuple(item.split("=", 1)) for item in items)  # type: ignore[misc]


def _crossovers(text: str, name: str) -> str:
    """The ``@`` part as a ``JOBRUNNER_QUANT_KERNEL_TOKENS`` value (its scheme names are checked at load)."""
    pairs = _pairs(text, name)
    if any(not value.isdigit() for _, value in pairs):
        raise ValueError(f"{name!r}: a crossover is SCHEME=TOKENS (int4=8)")
    return ",".join(f"{key}={value}" for key, value in pairs)


@contextmanager
def crossover_env(value: str) -> Iterator[None]:
    """``$JOBRUNNER_QUANT_KERNEL_TOKENS`` = ``value`` inside the block (unchanged when ``value`` is empty)."""
    with overridden(CROSSOVER_ENV, value):
        yield


def comparison_config(**settings: Any) -> Any:
    """An ``EngineConfig`` for a comparison engine: ``settings`` (None: the default), prefix caching and
    speculation off (see the module docstring)."""
    from jobrunner.engine import EngineConfig

    given = {k: v for k, v in settings.items() if v is not None}
    return EngineConfig(**given, enable_prefix_caching=False, speculative="off")


def load_engine(source: str, config: QuantConfig, engine_config: Any) -> Any:
    """An ``LLMEngine`` on ``source`` quantized as ``config`` says, its crossovers applied while it loads."""
    from jobrunner.engine import LLMEngine

    with crossover_env(config.crossovers):
        if config.overrides:
            return _engine_with_overrides(source, config, engine_config)
        return LLMEngine.from_source(source, dtype=config.dtype, quantization=config.scheme, config=engine_config)


def _engine_with_overrides(source: str, config: QuantConfig, engine_config: Any) -> Any:
    """The base scheme with per-layer overrides (``int4/lm_head=int8``; not a job-spec value). The model loads
    with its bf16 linears left as ``nn.Linear`` (a packed linear is not one quantize_model swaps: the overrides
    were silently not applied on CPUs that pack bf16 weights), is quantized, then the layers left in bf16 are
    packed as a load would."""
    import torch

    from jobrunner.engine import LLMEngine
    from jobrunner.models.factory import load_for_engine
    from jobrunner.models.onednn_linear import reorder_bf16_linears
    from jobrunner.quant.apply import quantize_model

    with overridden("JOBRUNNER_AMX_GEMM", "0"), overridden("JOBRUNNER_ONEDNN_LINEAR", "0"):
        model, tokenizer, eos_ids, info = load_for_engine(source, dtype=config.dtype, device=engine_config.device)
    info["quantization"] = config.name
    scheme = "int8" if config.scheme == INT8_WEIGHT_ONLY else config.scheme  # quantize_model's int8: weight-only
    info["quantization_report"] = quantize_model(model, scheme, overrides=dict(config.overrides)).summary()
    if model.dtype == torch.bfloat16 and next(model.parameters()).device.type == "cpu":
        reorder_bf16_linears(model)
    return LLMEngine(model, tokenizer, engine_config, eos_ids, info)
