"""Build our model for a Hugging Face config and load its weights (fusing q|k|v and gate|up on the fly)."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from jobrunner.models import moe
from jobrunner.models.gemma import GEMMA_ARCHITECTURES, GemmaForCausalLM
from jobrunner.models.heads import split_architecture
from jobrunner.models.llama import LlamaForCausalLM

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",  # checkpoint already fused (qkv_proj, gate_up_proj): copied whole, see models/phi3.py
    *moe.MOE_ARCHITECTURES,
    *GEMMA_ARCHITECTURES,  # Gemma2ForCausalLM, Gemma3ForCausalLM (text): jobrunner.models.gemma
)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", 0),  # Qwen2-MoE
    "mlp.shared_expert.up_proj": ("mlp.shared_expert.gate_up_proj", 1),
}


def check_architecture(config) -> str:
    """The config's architecture, or a ValueError listing the supported ones (a Llama-family decoder may carry
    a sequence-classification head or none: ``Qwen2ForSequenceClassification``, ``LlamaModel``)."""
    archs = getattr(config, "architectures", None) or []
    arch = archs[0] if archs else f"<model_type={getattr(config, 'model_type', '?')}>"
    family, head = split_architecture(arch)
    if family not in SUPPORTED_ARCHITECTURES or (head != "lm" and family in GEMMA_ARCHITECTURES):
        raise ValueError(
            f"unsupported model architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}, and the "
            "non-Gemma ones as ...ForSequenceClassification or bare ...Model checkpoints"
        )
    return arch


def build_model(config, dtype: torch.dtype, device: torch.device, max_positions: int | None = None
                ) -> LlamaForCausalLM:
    """An uninitialised model on ``device`` (weights to be loaded, or randomly initialised by the caller)."""
    arch = check_architecture(config)
    model_class = GemmaForCausalLM if split_architecture(arch)[0] in GEMMA_ARCHITECTURES else LlamaForCausalLM
    with torch.device("meta"):
        model = model_class(config, max_positions)
    model = model.to_empty(device=device).to(dtype=dtype)
    if model.shape.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    for module in model.modules():  # rope tables (Gemma: one per layer type, and its embedding scale) in float32
        if hasattr(module, "build_tables"):
            module.build_tables(device)
    # inference only: no parameter asks autograd to keep activations (a CUDA graph captured over such a forward
    # would hold them in its private pool: attention/graph_capture.py)
    model.requires_grad_(False)
    return model.eval()


def load_weights(model: LlamaForCausalLM, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy Hugging Face-named tensors into ``model``; raise naming any parameter left unloaded."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for name, tensor in named_tensors:
        target = _target(model, name)
        if target is None:
            continue
        param_name, part = target
        param = params[param_name]
        with torch.no_grad():
            _slice(model, param_name, param, part).copy_(tensor.to(param.dtype))
        loaded.add(param_name if part is None else f"{param_name}#{part}")
    _check_all_loaded(model, params, loaded)


def _target(model: LlamaForCausalLM, name: str) -> tuple[str, int | tuple | None] | None:
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name == "lm_head.weight":
        return None if model.shape.tie_word_embeddings or model.lm_head is None else ("lm_head.weight", None)
    if name == "score.weight":
        return ("score.weight", None) if getattr(model, "score", None) is not None else None
    if model.shape.head == "none" and not name.startswith("model."):  # a bare decoder (AutoModel) checkpoint
        name = "model." + name
    if name.startswith("model.") and not name.startswith("model.layers."):
        return name[len("model."):], None
    match = _LAYER.match(name)
    if not match:
        return None
    index, rest = match.groups()
    expert = moe.checkpoint_target(rest)  # per-expert tensors, Mixtral's block_sparse_moe names
    if expert is not None:
        return f"layers.{index}.{expert[0]}", expert[1]
    module, _, kind = rest.rpartition(".")
    if module in _FUSED:
        fused, part = _FUSED[module]
        return f"layers.{index}.{fused}.{kind}", part
    return f"layers.{index}.{rest}", None


def _slice(model: LlamaForCausalLM, param_name: str, param: torch.Tensor, part: int | tuple | None
           ) -> torch.Tensor:
    if part is None:
        return param
    if isinstance(part, tuple):  # one expert of a stacked MoE tensor
        return moe.expert_slice(param, part)
    s = model.shape
    if "qkv_proj" in param_name:
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        bounds = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][part]
    else:  # gate|up: the dense MLP's, or a shared expert's (its own intermediate size)
        half = param.shape[0] // 2
        bounds = [(0, half), (half, 2 * half)][part]
    return param[bounds[0]:bounds[1]]


def _check_all_loaded(model: LlamaForCausalLM, params: dict, loaded: set[str]) -> None:
    missing = []
    for name in params:
        if name == "lm_head.weight" and model.shape.tie_word_embeddings:
            continue
        if "qkv_proj" in name:
            parts = [f"{name}#{i}" for i in range(3)]
        elif name.endswith(moe.STACKED):  # the stacked tensor whole, or every expert's part
            parts = [] if name in loaded else [f"{name}#{p}" for p in moe.expert_parts(params[name], name)]
        elif "gate_up_proj" in name:
            parts = [f"{name}#{i}" for i in range(2)]
        else:
            parts = [name]
        missing += [p for p in parts if p not in loaded and name not in loaded]  # or loaded whole (Phi-3)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weight(s), e.g. {', '.join(missing[:5])}")
