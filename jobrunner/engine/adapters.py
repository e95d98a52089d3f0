"""The engine's side of LoRA adapters (models/lora.py): loading them, what they rule out, their memory.

Adapters are attached to the model (``model.lora``), so an engine rebuilt over the same model keeps them.
A request names its adapter (``LLMEngine.add_request(..., adapter=name)``); its prefix-cache blocks are keyed
by the adapter (kv_cache/manager.py) and every step groups the adapted layers' matmuls per adapter
(model_runner.py). Not combined with: deterministic mode (its fixed row tiles would cut an adapter's row
groups) and CUDA graphs (the row groups change every step; a graph would replay the captured ones).

Memory: the adapters' weights sit on the model's device before the KV cache is sized, so on CUDA the free
memory the cache is planned from already excludes them, and :func:`adapter_workspace_bytes` (one step's LoRA
intermediates at the full token budget) is kept back from it too. On CPU ``kv_cache_memory_bytes`` sizes the
KV cache alone, as without adapters; the adapters' bytes are recorded (``model_info["adapter_bytes"]``).
"""

from __future__ import annotations

from typing import Any

import torch

from jobrunner.engine.config import EngineConfig


def load_adapters_onto(model: torch.nn.Module, adapters: dict[str, str], *, cache_dir: str | None = None,
                       storage_options: dict | None = None, revision: str | None = None) -> Any:
    """Fetch each ``name -> source`` PEFT adapter (local dir, Hub id, storage URL) and attach them to ``model``;
    returns the model's AdapterSet. ValueError naming the adapter on a bad source or an unsupported adapter."""
    from jobrunner.models.adapter_sources import resolve_adapter_dir
    from jobrunner.models.lora import attach_adapters, load_adapters

    for name in adapters:
        check_adapter_name(name)
    dirs = {name: (source, resolve_adapter_dir(name, source, cache_dir=cache_dir, revision=revision,
                                               storage_options=storage_options))
            for name, source in adapters.items()}
    return attach_adapters(model, load_adapters(model, dirs))


def check_adapter_name(name: Any) -> None:
    """An adapter name is a non-empty string without surrounding blanks (rows name it in their column)."""
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise ValueError(f"adapter name must be a non-empty string without surrounding blanks, got {name!r}")


def check_engine_with_adapters(adapters: Any, config: EngineConfig, device: torch.device) -> None:
    """Refuse the engine settings adapters cannot run with, naming the setting."""
    if adapters is None:
        return
    if config.deterministic:
        raise ValueError("engine.deterministic is not supported with model.adapters: the fixed row tiles of "
                         "deterministic mode would cut the per-adapter row groups of a step")
    if config.graphs_on(device.type):
        raise ValueError("engine.use_cuda_graphs is not supported with model.adapters: the rows of each adapter "
                         "change every step, which a CUDA graph cannot capture; run with use_cuda_graphs: false")


def adapter_workspace_bytes(adapters: Any, model: torch.nn.Module, num_tokens: int) -> int:
    """Bytes of one step's LoRA intermediates at ``num_tokens`` tokens: the gathered input rows, the rank-wide
    product and the update of the widest adapted layer (freed after each layer; one layer at a time)."""
    if adapters is None:
        return 0
    s = model.shape
    widest = max(s.hidden_size, 2 * s.intermediate_size, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim)
    return num_tokens * (2 * widest + adapters.max_rank_sum) * model.dtype.itemsize


def record_adapters(adapters: Any, model_info: dict[str, Any]) -> None:
    """What ``model_info`` (the manifest's model section) says of the adapters."""
    if adapters is not None:
        model_info["adapters"] = adapters.describe()
        model_info["adapter_bytes"] = adapters.num_bytes
