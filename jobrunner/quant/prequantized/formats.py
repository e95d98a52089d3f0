"""Read a checkpoint's ``quantization_config`` (config.json) into :class:`CheckpointQuant`, or refuse it in one line.

Loaded as they are (no float detour), into our own layers:

* compressed-tensors FP8 (``quant_method: compressed-tensors``, ``format: float-quantized``): e4m3 weights with
  per-tensor or per-channel scales, activations dynamic per token -> :class:`~jobrunner.quant.fp8.Fp8Linear`.
* GPTQ (``quant_method: gptq``): 4-bit, group 32 / 64 / 128 / 256 or per channel (``group_size: -1``),
  symmetric or not, ``desc_act: false``, the v1 or v2 zero-point format -> our int4 layout.
* AWQ (``quant_method: awq``): 4-bit, group 32 / 64 / 128 / 256, with zero points or not (its ``qzeros`` read
  either way), GEMM layout -> our int4 layout.

Anything else (another quant_method, 3 or 8 bits, ``desc_act: true``, AWQ's GEMV / Marlin layouts, static
activation scales, a quantized KV cache, sparsity, ...) raises ``ValueError`` naming the option.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

INT4_GROUPS = (32, 64, 128, 256)  # what our int4 kernels take (quant.kernels.INT4_GROUP_SIZES)
SUPPORTED = "compressed-tensors FP8 (float-quantized), gptq 4-bit (desc_act false), awq 4-bit GEMM"
PREFIX = "checkpoint quantization_config"


@dataclass(frozen=True)
class CheckpointQuant:
    """A pre-quantized checkpoint's format, as far as loading it needs to know.

    ``method``: ``fp8`` (compressed-tensors) | ``gptq`` | ``awq``; ``scheme``: ours that runs it (``fp8`` |
    ``int4``). ``group_size`` None = one group per output channel. ``weight_scales`` (fp8): ``tensor`` |
    ``channel``. ``zero_format`` (gptq): ``v1`` (zeros stored minus one) | ``v2``. ``ignore``: the checkpoint's
    names (or ``re:`` patterns) of the modules it left in float.
    """

    method: str
    scheme: str
    bits: int
    group_size: int | None = None
    symmetric: bool = True
    weight_scales: str | None = None
    zero_format: str | None = None
    ignore: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for the manifest and ``validate``, e.g. ``gptq 4-bit, group 128, asymmetric (v1 zeros)``."""
        if self.method == "fp8":
            return (f"compressed-tensors fp8 e4m3, per-{self.weight_scales} weight scales, dynamic per-token "
                    "activations")
        group = "per channel" if self.group_size is None else f"group {self.group_size}"
        zeros = "symmetric" if self.symmetric else "asymmetric"
        layout = f" ({self.zero_format} zeros)" if self.method == "gptq" else " (GEMM layout)"
        return f"{self.method} {self.bits}-bit, {group}, {zeros}{layout}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, for the manifest."""
        return {**asdict(self), "ignore": list(self.ignore), "description": self.describe()}


def read_checkpoint_quant(quantization_config: Any) -> CheckpointQuant | None:
    """``quantization_config`` (a dict, an object with ``to_dict()``, or None) -> its format; None when the
    checkpoint is not quantized. ``ValueError`` naming the first unsupported option."""
    if quantization_config is None:
        return None
    config = quantization_config.to_dict() if hasattr(quantization_config, "to_dict") else quantization_config
    if not isinstance(config, dict):
        raise ValueError(f"{PREFIX} is not a mapping: {config!r}")
    method = str(config.get("quant_method", "")).lower()
    readers = {"compressed-tensors": _read_compressed_tensors, "gptq": _read_gptq, "awq": _read_awq}
    if method not in readers:
        raise ValueError(f"{PREFIX}: quant_method {method or None!r} is not supported (supported: {SUPPORTED})")
    return readers[method](config)


def resolve_scheme(requested: str, found: CheckpointQuant | None) -> str:
    """The scheme a load runs: the checkpoint's when it has one (``requested`` ``none`` or the same), else
    ``requested``. ``ValueError`` naming both when they disagree."""
    if found is None or requested in ("none", found.scheme):
        return found.scheme if found is not None else requested
    raise ValueError(f"model.quantization {requested!r} conflicts with the checkpoint's own quantization "
                     f"({found.describe()}, loaded as {found.scheme}): set model.quantization to "
                     f"{found.scheme!r} or 'none', or use a float checkpoint")


def _refuse(what: str) -> ValueError:
    return ValueError(f"{PREFIX}: {what} is not supported (supported: {SUPPORTED})")


def _read_gptq(config: dict) -> CheckpointQuant:
    bits = config.get("bits")
    if bits != 4:
        raise _refuse(f"gptq bits {bits!r}")
    if config.get("desc_act"):
        raise _refuse("gptq desc_act: true (activation order)")
    if config.get("lm_head"):
        raise _refuse("gptq lm_head: true (a quantized head)")
    if config.get("dynamic"):
        raise _refuse("gptq dynamic (per-module overrides)")
    fmt = str(config.get("checkpoint_format") or config.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"gptq checkpoint_format {fmt!r}")
    pack = str(config.get("pack_dtype") or "int32").removeprefix("torch.")
    if pack != "int32":
        raise _refuse(f"gptq pack_dtype {pack!r}")
    return CheckpointQuant("gptq", "int4", 4, _group(config.get("group_size"), "gptq"),
                           symmetric=bool(config.get("sym", True)), zero_format="v2" if fmt == "gptq_v2" else "v1",
                           ignore=tuple(config.get("modules_to_not_convert") or ()))


def _read_awq(config: dict) -> CheckpointQuant:
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise _refuse(f"awq bits {bits!r}")
    version = str(config.get("version") or config.get("format") or "gemm").lower()
    if version != "gemm":
        raise _refuse(f"awq version {version!r} (only the GEMM layout)")
    group = config.get("group_size", config.get("q_group_size"))
    if group in (None, -1):
        raise _refuse(f"awq group_size {group!r}")
    # zero_point false: symmetric, but the GEMM layout still stores its zeros (all 8): read as they are
    return CheckpointQuant("awq", "int4", 4, _group(group, "awq"), symmetric=config.get("zero_point") is False,
                           ignore=tuple(config.get("modules_to_not_convert") or ()))


def _group(value: Any, method: str) -> int | None:
    if value in (-1, None):
        return None
    if value not in INT4_GROUPS:
        raise _refuse(f"{method} group_size {value!r} (our int4 takes {', '.join(map(str, INT4_GROUPS))} or -1)")
    return int(value)


def _read_compressed_tensors(config: dict) -> CheckpointQuant:
    fmt = config.get("format")
    if fmt != "float-quantized":
        raise _refuse(f"compressed-tensors format {fmt!r}")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if config.get(key):
            raise _refuse(f"compressed-tensors {key}")
    status = config.get("quantization_status", "compressed")
    if status not in ("compressed", "frozen"):
        raise _refuse(f"compressed-tensors quantization_status {status!r}")
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse(f"compressed-tensors with {len(groups)} config groups (one FP8 group expected)")
    name, group = next(iter(groups.items()))
    strategy = _fp8_group(name, group)
    return CheckpointQuant("fp8", "fp8", 8, weight_scales=strategy, ignore=tuple(config.get("ignore") or ()))


def _fp8_group(name: str, group: dict) -> str:
    """The weight-scale strategy of one compressed-tensors group, after checking it is FP8 with dynamic
    per-token activations."""
    where = f"compressed-tensors config_groups.{name}"
    if group.get("format", "float-quantized") != "float-quantized":
        raise _refuse(f"{where}.format {group.get('format')!r}")
    if list(group.get("targets") or []) != ["Linear"]:
        raise _refuse(f"{where}.targets {group.get('targets')!r} (only ['Linear'])")
    if group.get("output_activations"):
        raise _refuse(f"{where}.output_activations")
    weights = group.get("weights") or {}
    if (weights.get("type"), weights.get("num_bits")) != ("float", 8):
        raise _refuse(f"{where}.weights {weights.get('type')!r} {weights.get('num_bits')!r}-bit")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel") or not weights.get("symmetric", True) or weights.get("dynamic"):
        raise _refuse(f"{where}.weights strategy {strategy!r} (symmetric, static, tensor or channel)")
    acts = group.get("input_activations")
    if not acts:
        raise _refuse(f"{where} without input_activations (FP8 weight-only; only dynamic per-token activations)")
    if (acts.get("type"), acts.get("num_bits"), acts.get("strategy"), acts.get("dynamic")) != \
            ("float", 8, "token", True):
        raise _refuse(f"{where}.input_activations {acts.get('strategy')!r} dynamic={acts.get('dynamic')!r} "
                      "(only dynamic per-token FP8; static activation scales are not)")
    return strategy
