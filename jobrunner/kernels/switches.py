"""Every ``JOBRUNNER_*`` environment variable of the project, in one table, and the one place that reads them.

Each row says the variable's name, its default, what it chooses and the CPU capabilities (or devices) where it
changes anything. Code asks :func:`switch` (a typed value) or :func:`setting` (the raw text, for the few with
their own small syntax), never ``os.environ``: ``tests/kernels/test_switches.py`` greps the package for a
``JOBRUNNER_*`` read anywhere else. ``jobrunner doctor`` prints the table with the current values; the
documentation's copy is the table in docs/engine.md, *Native kernels*.

Kinds: ``onoff`` (``0`` off, ``1`` on, unset: the default, which for most kernels is "where the capability
says"; :func:`switch` gives ``False`` / ``True`` / ``None``), ``choice`` (one of ``choices``), ``int`` /
``float``, ``text`` (read as written; its user parses it and names the variable on a bad value).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

ALL = "all"  # applies on every CPU (and GPU)


@dataclass(frozen=True)
class Switch:
    """One environment variable: what it chooses and where it applies."""

    name: str
    default: str  # the value an unset variable means ("" where the default is the capability's choice)
    kind: str  # onoff | choice | int | float | text
    chooses: str  # what it chooses, one line
    capabilities: str = ALL  # where it changes anything: a capability list, "cuda", or "all"
    choices: tuple[str, ...] = ()
    kernel: bool = True  # chooses a kernel or a code path (False: a run's settings, paths, names)


_ROWS = (
    # the CPU and the native build
    Switch("JOBRUNNER_CPU_CAPABILITY", "", "choice", "force the CPU capability: the kernels, the C build's -march "
           "and the float dtype (bf16 on avx512_bf16 / amx) follow it; unset: detected",
           choices=("default", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx")),
    # attention
    Switch("JOBRUNNER_ATTENTION_NATIVE", "1", "onoff", "the cpu_paged attention kernel (0: the torch backend)"),
    Switch("JOBRUNNER_ATTENTION_FAST", "1", "onoff", "the fast prompt-chunk kernel (query vectors in the lanes) "
           "and shared-prefix decodes of AVX-512 / AVX2 builds (0: choose as the portable build)",
           "avx2, avx512, avx512_vnni, avx512_bf16, amx"),
    Switch("JOBRUNNER_ATTENTION_SHARED", "1", "onoff", "decodes sharing cached prefix blocks read them once per "
           "group (fast kernel, outside deterministic mode)", "avx2, avx512, avx512_vnni, avx512_bf16, amx"),
    Switch("JOBRUNNER_ATTENTION_BF16_SDPA", "", "onoff", "bf16 prompt chunks over 64 tokens to torch's SDPA (the "
           "matrix units); unset: on with AMX", "amx (1 forces it anywhere)"),
    Switch("JOBRUNNER_ATTENTION_AMX", "", "onoff", "bf16 prompt chunks on the tile attention kernel (AMX tiles, "
           "or vdpbf16ps without AMX); unset: on with AMX or AVX-512 BF16", "avx512_bf16, amx"),
    Switch("JOBRUNNER_ATTENTION_AMX_DECODE", "grouped", "choice", "bf16 decodes on the tile decode kernel: "
           "grouped (decodes sharing a prefix read it once per group), all (each row alone), 0 off",
           "avx512_bf16, amx",
           choices=("grouped", "all", "0")),
    # GEMMs and row ops
    Switch("JOBRUNNER_AMX_GEMM", "", "onoff", "bf16 linears on the packed GEMM (AMX tiles; AVX-512 BF16 without "
           "AMX); unset: on with AMX up to its size limit, 1 past it, and on avx512_bf16", "avx512_bf16, amx"),
    Switch("JOBRUNNER_ONEDNN_LINEAR", "", "onoff", "bf16 linears on oneDNN-reordered weights; unset: on with AMX",
           "avx512_bf16, amx"),
    Switch("JOBRUNNER_PACKED_GEMM", "", "onoff", "float32 linears on the packed-panel GEMM; unset: on with avx2",
           "avx2 (1 forces it on avx512*, amx)"),
    Switch("JOBRUNNER_FUSED_OPS", "1", "onoff", "the fused row ops (RMSNorm + add, rotary, SiLU * up) in C"),
    Switch("JOBRUNNER_LAYER_LOOP", "1", "onoff", "a step's layers in one C call (needs the packed bf16 GEMM: "
           "decode steps with AMX, steps up to 2,048 tokens on avx512_bf16)", "avx512_bf16, amx"),
    Switch("JOBRUNNER_NATIVE_ARGMAX", "1", "onoff", "the greedy sampler's row argmax in C"),
    Switch("JOBRUNNER_HUGE_PAGES", "0", "choice", "transparent huge pages for the packed weights (weights) or the "
           "KV cache too (all)", "all (Linux)", choices=("0", "weights", "all")),
    # quantization
    Switch("JOBRUNNER_QUANT_NATIVE", "1", "onoff", "the quant kernels' C (int4 unpack, int4 -> int8, W8A8 "
           "activation loops)"),
    Switch("JOBRUNNER_W8A8_VNNI", "", "onoff", "W8A8 layers on the AVX-512 VNNI kernel (quantize, int8 product and "
           "scaling in one call); unset: on with avx512_bf16", "avx512_bf16"),
    Switch("JOBRUNNER_W8A8_AMX", "", "onoff", "W8A8 layers on our AMX-INT8 tile kernel (opt-in until measured on "
           "AMX hardware; oneDNN's int8 GEMM otherwise)", "amx"),
    Switch("JOBRUNNER_QUANT_KERNEL_TOKENS", "", "text", "move the quantized layers' crossovers (\"int8=8,int4=64\"; "
           "int4_int8=0 turns W4A8 off)"),
    Switch("JOBRUNNER_TRITON_QUANT", "", "text", "the opt-in Triton quant kernels (1 / all, or fp8,int8,int4)",
           "cuda"),
    # a run's settings (not kernels)
    Switch("JOBRUNNER_CACHE", "~/.cache/jobrunner", "text", "the cache root (models, assembled GGUF files)",
           kernel=False),
    Switch("JOBRUNNER_DATE", "", "text", "the {date} of output URLs (YYYY-MM-DD; unset: today, UTC)", kernel=False),
    Switch("JOBRUNNER_DATETIME", "", "text", "the {datetime} of output URLs (unset: now, UTC)", kernel=False),
    Switch("JOBRUNNER_RUN_ID", "", "text", "the {run_id} of output URLs (unset: 12 random hex digits)",
           kernel=False),
    Switch("JOBRUNNER_METRICS_INTERVAL_S", "2", "float", "seconds between a worker's engine samples (at least 0.1)",
           kernel=False),
    Switch("JOBRUNNER_JOB_SPEC", "", "text", "a submitted job's spec (JSON, set by jobrunner submit)",
           kernel=False),
    Switch("JOBRUNNER_PYTHON", "", "text", "the Python a submitted job runs with (submit --python)", kernel=False),
    Switch("JOBRUNNER_VLLM_PYTHON", "", "text", "the Python that has vLLM (unset: ./.venv-vllm/bin/python, "
           "else this one)", kernel=False),
)
SWITCHES: dict[str, Switch] = {row.name: row for row in _ROWS}
_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def setting(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The variable's text as set (stripped), or its default when unset or empty. ``environ``: read from this
    mapping instead of the process environment (a job's own variables)."""
    row = _row(name)
    return (os.environ if environ is None else environ).get(name, "").strip() or row.default


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the variable is set to something (not empty)."""
    _row(name)
    return bool((os.environ if environ is None else environ).get(name, "").strip())


def switch(name: str) -> bool | str | int | float | None:
    """The variable's typed value: ``onoff`` -> True / False, or None when unset with no fixed default (the
    capability decides); ``choice`` -> one of its choices (lowercase), ``""`` when unset without a default;
    ``int`` / ``float`` -> a number; ``text`` -> the text. ValueError naming the variable on a bad value."""
    row = _row(name)
    value = setting(name)
    if row.kind == "onoff":
        if not value:
            return None
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
        raise ValueError(f"{name}={value!r}: expected 0 or 1")
    if row.kind == "choice":
        if value and value.lower() not in row.choices:
            raise ValueError(f"{name}={value!r}: expected one of {', '.join(row.choices)}")
        return value.lower()
    if row.kind in ("int", "float"):
        try:
            return int(value) if row.kind == "int" else float(value)
        except ValueError:
            raise ValueError(f"{name}={value!r}: expected a number") from None
    return value


def is_off(name: str) -> bool:
    """Whether an on/off switch is set to off (``0``): the common question of a kernel with a fallback."""
    return switch(name) is False


@contextmanager
def overridden(name: str, value: str) -> Iterator[None]:
    """The variable set to ``value`` inside the block, restored after (unchanged when ``value`` is empty)."""
    _row(name)
    saved = os.environ.get(name)
    if value:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def table() -> list[dict[str, str]]:
    """Every switch with its current value (as set; ``""`` when unset), for ``jobrunner doctor``."""
    return [{"name": row.name, "value": os.environ.get(row.name, "").strip(), "default": row.default,
             "kind": row.kind, "applies": row.capabilities, "chooses": row.chooses} for row in _ROWS]


def _row(name: str) -> Switch:
    try:
        return SWITCHES[name]
    except KeyError:
        raise KeyError(f"{name} is not in jobrunner.kernels.switches.SWITCHES (add its row there)") from None
