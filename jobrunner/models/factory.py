"""From a model source to a ready model + tokenizer on a device (what ``LLMEngine.from_source`` calls)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from jobrunner.models.loader import build_model, check_architecture, load_weights
from jobrunner.models.parallel import TensorParallel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """"auto" means the first CUDA device when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def choose_dtype(dtype: str, device: torch.device) -> tuple[torch.dtype, dict[str, Any]]:
    """The model dtype for ``dtype`` on ``device``, and how it was chosen (recorded in the manifest).

    CPU ``auto`` asks :func:`jobrunner.quant.dispatch.choose_cpu_dtype`: bfloat16 on bf16 hardware (avx512_bf16
    / AMX), else float32, from the CPU capability alone (no timing); ``JOBRUNNER_CPU_CAPABILITY`` forces it.
    """
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16, {"requested": "auto", "chosen": "bfloat16", "reason": "cuda"}
        from jobrunner.quant.dispatch import choose_cpu_dtype

        chosen, why = choose_cpu_dtype()
        return chosen, {"requested": "auto", **why}
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype], {"requested": dtype, "chosen": dtype}


def describe_dtype_choice(choice: dict[str, Any]) -> str:
    """One line for the manifest (its ``model`` section keeps plain values only)."""
    text = f"{choice['requested']} -> {choice['chosen']}"
    if choice.get("reason"):
        text += f": {choice['reason']}" + (" (forced by JOBRUNNER_CPU_CAPABILITY)" if choice.get("forced") else "")
    return text


def describe_dispatch(dispatch: dict[str, Any] | None) -> str | None:
    """The quantized layers' dispatch as one line for the manifest, e.g.
    ``cpu avx2: int8 kernel <= 256 tokens, int4 kernel <= 256 tokens, else dequantized float32 tiles``."""
    if not dispatch:
        return None
    from jobrunner.quant.dispatch import NO_LIMIT

    limits = dict(dispatch["max_kernel_tokens"])
    int4_int8 = limits.pop("int4_int8", 0)
    kernels = ", ".join(f"{s} kernel <= {n} tokens" for s, n in limits.items())
    extra = "; fp8 via _scaled_mm" if dispatch.get("fp8_native") else ""
    if int4_int8 > limits.get("int4", 0):  # int4's W4A8 batch path (quant.int4_int8) instead of its float tiles
        extra += f"; int4 above {limits.get('int4', 0)} tokens: int8 GEMM, int8 activations (W4A8)" + (
            f" up to {int4_int8} tokens" if int4_int8 < NO_LIMIT else "")
    if dispatch.get("w8a8_kernel"):
        extra += f"; w8a8 via {dispatch['w8a8_kernel']}"
    triton = dispatch.get("triton_quant")  # opt-in, JOBRUNNER_TRITON_QUANT
    if triton:
        extra += f"; triton at batch: {','.join(triton['enabled']) or 'none'}" + "".join(
            f" ({scheme} off: {why})" for scheme, why in triton["reasons"].items())
    return f"{dispatch['device']} {dispatch['capability']}: {kernels}, else dequantized " \
           f"{dispatch['dequant_dtype']} tiles{extra}"


def describe_quant_layers(summary: dict[str, Any]) -> str:
    """Layers per scheme, size and why a layer is not in the job's scheme, as one line for the manifest, e.g.
    ``int4 120, int8 1 (lm_head: int4 keeps the head in int8); 99.2 MB, 0.366x of bf16``."""
    from jobrunner.quant.apply import INT4_INT8_NOTE

    scheme = summary.get("scheme")
    why = [f"{f['name']}: {f['reason']}" for f in summary.get("fallbacks", [])]
    why += [f"{n.split(' ')[0]}: int4 keeps the head in int8" for n in summary.get("notes", []) if INT4_INT8_NOTE in n]
    counts = ", ".join(f"{s} {n}" for s, n in sorted(summary.get("layers", {}).items(), key=lambda i: i[0] != scheme))
    detail = f" ({'; '.join(why[:3])}{'; …' if len(why) > 3 else ''})" if why else ""
    size = f"; {summary.get('model_bytes_after', 0) / 1e6:.1f} MB, {summary.get('model_ratio_vs_bf16', 0):.3f}x of bf16"
    return counts + detail + size


def eos_token_ids(model_dir: Path, tokenizer) -> list[int]:
    """EOS ids from generation_config.json (int or list) plus the tokenizer's own."""
    ids: list[int] = []
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
        ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def load_for_engine(source: str, *, dtype: str = "auto", device: str = "auto", quantization: str = "none",
                    max_model_len: int | None = None, allow_pickle: bool = False,
                    tensor_parallel: TensorParallel | None = None,
                    **source_options: Any) -> tuple[torch.nn.Module, Any, list[int], dict[str, Any]]:
    """Resolve ``source``, build our model, load its weights, quantize if asked.

    A pre-quantized checkpoint (a ``quantization_config`` in its config.json: compressed-tensors FP8, GPTQ, AWQ;
    :mod:`jobrunner.quant.prequantized`) is loaded as it is: ``quantization`` ``none`` or the scheme that runs
    it (``fp8`` / ``int4``), any other is refused naming both.

    ``tensor_parallel``: load only this rank's shard (:mod:`jobrunner.models.parallel`), each checkpoint tensor
    sliced as it streams (a pre-quantized checkpoint's packed tensors too: ``models/parallel/shard.py``).

    Returns ``(model, tokenizer, eos_token_ids, model_info)``; ``model_info`` is what manifests record.
    """
    from jobrunner.models.load_memory import LoadMemory
    from jobrunner.models.sources import resolve_model_dir
    from jobrunner.models.stopwatch import Stopwatch
    from jobrunner.models.weights import Checkpoint, load_config, load_tokenizer
    from jobrunner.quant.choice import resolve_int8
    from jobrunner.quant.prequantized import read_checkpoint_quant, resolve_scheme

    clock = Stopwatch()
    model_dir = resolve_model_dir(source, allow_pickle=allow_pickle, **source_options)
    clock.mark("model_source")  # a cache hit, or the download / GGUF conversion
    config = load_config(model_dir)
    arch = check_architecture(config)
    clock.mark("config")  # the first one in a process imports transformers' config modules (~1.4 s)
    dev = resolve_device(device)
    torch_dtype, dtype_choice = choose_dtype(dtype, dev)
    found = read_checkpoint_quant(getattr(config, "quantization_config", None))  # pre-quantized, or None
    requested = quantization
    quantization = resolve_scheme(quantization, found)  # the checkpoint's own; a conflicting spec refused
    quantization, choice = resolve_int8(quantization, dev, torch_dtype)  # int8: the fastest int8 scheme here
    check_vision_quantization(arch, quantization)
    tp = tensor_parallel if tensor_parallel is not None and tensor_parallel.is_parallel else None
    model = build_model(config, torch_dtype, dev, _max_positions(config, max_model_len), materialize=False,
                        tensor_parallel=tp)
    clock.mark("build_model")
    checkpoint = Checkpoint(model_dir, allow_pickle=allow_pickle)
    transform = _prequantized_load(model, found, checkpoint, dev) if found else \
        _quantize_at_load(model, quantization, dev)
    with LoadMemory(dev) as memory:  # each tensor made on the device as it is read; each layer quantized then
        load_weights(model, checkpoint, device=dev, transform=transform)
    clock.mark("load_weights")
    info = {"source": source, "architecture": arch, "dtype": str(torch_dtype).removeprefix("torch."),
            "device": str(dev), "quantization": quantization, "dtype_choice": dtype_choice,
            "dtype_reason": describe_dtype_choice(dtype_choice), **load_memory_info(memory, model)}
    if choice is not None:
        info["quantization_requested"], info["quantization_choice"] = requested, choice
    if tp is not None:
        info["tensor_parallel"] = {"rank": tp.rank, "world": tp.world}
    if found is not None:  # recorded from the checkpoint's config.json, never guessed (a line: the manifest's)
        info["checkpoint_quantization"] = found.describe()
    if transform is not None:
        report = transform.report
        seconds = transform.session.seconds if found is None else 0.0  # pre-quantized: built as read
        clock.stages["load_weights"] -= seconds  # quantize-at-load ran inside the load
        clock.stages["quantize"] = round(seconds, 4)
        info["quantization_report"] = report.summary()
        info["quant_dispatch"] = report.dispatch  # which kernel runs for how many tokens on this machine
        info["quant_kernels"] = describe_dispatch(report.dispatch)  # the same as one string, for the manifest
        info["quant_layers"] = describe_quant_layers(info["quantization_report"])
    if dev.type == "cpu":  # linears on a packed / reordered weight where this CPU's capability says so
        from jobrunner.models.onednn_linear import reorder_bf16_linears
        from jobrunner.models.packed_linear import pack_linears

        num_packed, why = (reorder_bf16_linears if torch_dtype == torch.bfloat16 else pack_linears)(model)
        info["cpu_gemm"] = f"{why}; {num_packed} layers" if num_packed else why
        clock.mark("pack_weights")  # the first run on a machine also compiles the GEMM library
    info.update(head_info(config, model_dir, model))
    tokenizer = load_tokenizer(model_dir)
    if getattr(model, "is_vision_language", False):  # images in prompts: transformers' processor (models/vision)
        tokenizer = attach_processor(model, model_dir)
    eos_ids = eos_token_ids(model_dir, tokenizer)
    clock.mark("tokenizer")
    info["load_stages_s"] = clock.stages  # LLMEngine.from_source adds its own (adapters, engine)
    return model, tokenizer, eos_ids, info


def _prequantized_load(model: torch.nn.Module, found, checkpoint, device: torch.device):
    """The transform that builds a pre-quantized checkpoint's layers from its own tensors (models/prequantized)."""
    from jobrunner.models.prequantized import PrequantizedLoad

    names = checkpoint.names()
    if names is None:
        raise ValueError(f"pre-quantized checkpoint ({found.describe()}): load it from *.safetensors files")
    return PrequantizedLoad(model, found, names, device)


def _quantize_at_load(model: torch.nn.Module, quantization: str, device: torch.device):
    """The transform that quantizes each layer as it loads (quant/at_load.py), or None for ``none``."""
    if quantization == "none":
        return None
    from jobrunner.quant.at_load import QuantizeAtLoad

    return QuantizeAtLoad(model, quantization, device)


def load_memory_info(memory, model: torch.nn.Module) -> dict[str, Any]:
    """The manifest's load-memory keys: the weights' bytes as loaded (quantized or not), the load's peak host
    anonymous memory and its rise over the start of the load, and on CUDA the device's peak allocated bytes."""
    seen, weights = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            weights += tensor.numel() * tensor.element_size()
    found = memory.to_dict()
    return {"weights_bytes": weights, "load_host_anon_peak_bytes": found["host_anon_peak_bytes"],
            "load_host_anon_rise_bytes": found["host_anon_rise_bytes"],
            "load_device_peak_bytes": found["device_peak_bytes"]}


def head_info(config, model_dir: Path, model: torch.nn.Module) -> dict[str, Any]:
    """The model's head, embedding size, pooling (models/heads.py) and label names, for embed / score jobs.

    A pooling the engine cannot compute is recorded as ``pooling_error`` (an embed job refuses it; a
    generation job does not care)."""
    from jobrunner.models.heads import label_names, pooling_config

    shape = model.shape
    info: dict[str, Any] = {"head": getattr(shape, "head", "lm"), "hidden_size": shape.hidden_size}
    try:
        info.update(pooling_config(model_dir))
    except ValueError as exc:
        info.update(pooling=None, normalize=False, pooling_error=str(exc))
    if info["head"] == "classifier":
        info["labels"] = label_names(config)
    return info


def check_vision_quantization(arch: str, quantization: str) -> None:
    """A vision-language model loads unquantized only (its vision tower's linears are neither quantized nor
    packed yet): refused before any weight is read."""
    from jobrunner.models.vision.idefics3 import VISION_ARCHITECTURES

    if arch in VISION_ARCHITECTURES and quantization != "none":
        raise ValueError(f"{arch}: quantization {quantization!r} is not supported for vision-language models yet "
                         "(use quantization: none)")


def attach_processor(model: torch.nn.Module, model_dir: Path):
    """Load the model's image + text processor onto it (``model.processor``); its tokenizer is the engine's."""
    from transformers import AutoProcessor

    arch = model.shape.architecture
    try:
        model.processor = AutoProcessor.from_pretrained(str(model_dir), trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{arch}: could not load the image processor from {model_dir} "
                         f"(processor_config.json / preprocessor_config.json): {exc}") from exc
    return model.processor.tokenizer


def _max_positions(config, max_model_len: int | None) -> int:
    config = config if hasattr(config, "max_position_embeddings") else config.text_config  # a VLM: its decoder
    limit = config.max_position_embeddings
    return min(limit, max_model_len) if max_model_len else limit
