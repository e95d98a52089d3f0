"""Build our model for a Hugging Face config and load its weights (fusing q|k|v and gate|up on the fly:
:mod:`jobrunner.models.weight_map`), streamed tensor by tensor (:mod:`jobrunner.models.load_stream`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from jobrunner.models import moe
from jobrunner.models.gemma import GEMMA_ARCHITECTURES, GemmaForCausalLM
from jobrunner.models.heads import split_architecture
from jobrunner.models.llama import LlamaForCausalLM
from jobrunner.models.load_stream import LoadTransform, stream_weights
from jobrunner.models.parallel import TensorParallel
from jobrunner.models.vision.idefics3 import VISION_ARCHITECTURES, Idefics3ForConditionalGeneration

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",  # checkpoint already fused (qkv_proj, gate_up_proj): copied whole, see models/phi3.py
    *moe.MOE_ARCHITECTURES,
    *GEMMA_ARCHITECTURES,  # Gemma2ForCausalLM, Gemma3ForCausalLM (text): jobrunner.models.gemma
    *VISION_ARCHITECTURES,  # SmolVLM (Idefics3ForConditionalGeneration): jobrunner.models.vision
)


def check_architecture(config) -> str:
    """The config's architecture, or a ValueError listing the supported ones (a Llama-family decoder may carry
    a sequence-classification head or none: ``Qwen2ForSequenceClassification``, ``LlamaModel``)."""
    archs = getattr(config, "architectures", None) or []
    arch = archs[0] if archs else f"<model_type={getattr(config, 'model_type', '?')}>"
    family, head = split_architecture(arch)
    if arch in VISION_ARCHITECTURES:
        return arch
    if family not in SUPPORTED_ARCHITECTURES or (head != "lm" and family in GEMMA_ARCHITECTURES):
        raise ValueError(
            f"unsupported model architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}, and the "
            "non-Gemma ones as ...ForSequenceClassification or bare ...Model checkpoints"
        )
    return arch


def build_model(config, dtype: torch.dtype, device: torch.device, max_positions: int | None = None, *,
                materialize: bool = True, tensor_parallel: TensorParallel | None = None) -> LlamaForCausalLM:
    """Our model for ``config``, its parameters in ``dtype`` (set while on ``meta``: never a float32 copy first).

    ``materialize=True``: uninitialised parameters on ``device`` (weights to be loaded, or randomly initialised
    by the caller). ``materialize=False``: parameters stay on ``meta`` (no memory) for :func:`load_weights` to
    make on ``device`` one by one as the checkpoint is read. Rope tables are built on ``device`` either way.
    ``tensor_parallel``: build this rank's shard (:mod:`jobrunner.models.parallel`; :func:`load_weights` then
    slices each checkpoint tensor to it).
    """
    arch = check_architecture(config)
    model_class = GemmaForCausalLM if split_architecture(arch)[0] in GEMMA_ARCHITECTURES else LlamaForCausalLM
    model_class = Idefics3ForConditionalGeneration if arch in VISION_ARCHITECTURES else model_class
    with torch.device("meta"):
        model = model_class(config, max_positions, tensor_parallel)
    model = model.to(dtype=dtype)  # on meta: changes the recorded dtype, allocates nothing
    if materialize:
        model = model.to_empty(device=device)
        if model.shape.tie_word_embeddings:  # to_empty makes one tensor per registration: tie them again
            model.lm_head.weight = model.embed_tokens.weight
    for module in model.modules():  # rope tables (Gemma: one per layer type, and its embedding scale) in float32
        if hasattr(module, "build_tables"):
            module.build_tables(device)
    # inference only: no parameter asks autograd to keep activations (a CUDA graph captured over such a forward
    # would hold them in its private pool: attention/graph_capture.py)
    model.requires_grad_(False)
    return model.eval()


def load_weights(model: LlamaForCausalLM, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                 device: torch.device | str | None = None, transform: LoadTransform | None = None) -> None:
    """Copy Hugging Face-named tensors into ``model``; raise naming any parameter left unloaded.

    A parameter still on ``meta`` is made on ``device`` (default: where the model's rope tables are, else the
    CPU) when its first tensor arrives. ``transform``: a per-module / per-layer hook
    (:class:`jobrunner.models.load_stream.LoadTransform`: quantize each layer as soon as it is loaded, or
    build a pre-quantized checkpoint's modules from its own tensors). A
    :class:`jobrunner.models.weights.Checkpoint` names its tensors up front, so each layer is handed over
    the moment it is complete; a plain iterable's layers are handed over at the end.
    """
    stream_weights(model, named_tensors, torch.device(device) if device is not None else _home(model), transform)


def _home(model: torch.nn.Module) -> torch.device:
    """Where the model's non-meta tensors are (a materialised model, or the rope tables of a meta one)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if not tensor.is_meta:
            return tensor.device
    return torch.device("cpu")
