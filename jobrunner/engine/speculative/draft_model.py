"""The draft model of draft-model speculation: loaded like the target, checked to share its tokenizer, counted.

``EngineConfig.speculative`` set to a model source (alias, local dir, Hub id, storage URL: whatever
``model.source`` accepts) loads a second, small model on the target's device and dtype
(``draft_quantization`` quantizes it as ``model.quantization`` would). Its drafts are token ids the target then
scores, so both must map ids to the same strings: the model vocabulary sizes and a fingerprint of the tokenizer
(every token string and id, the special tokens) must be equal, else the engine refuses to start, naming both
models. Its weights and its KV cache are part of the engine's memory plan (``LLMEngine._num_kv_blocks`` gives
every KV block a draft block beside it; ``model_info`` records the bytes).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from jobrunner.engine.config import EngineConfig, is_draft_source


@dataclass
class DraftModel:
    """A loaded draft model: our model class, its tokenizer, where it came from, what the loader said."""

    model: torch.nn.Module
    tokenizer: Any
    source: str
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def weight_bytes(self) -> int:
        return module_bytes(self.model)

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of one KV block of ``block_size`` tokens in the draft's own cache (all its layers, K and V)."""
        s = self.model.shape
        return s.num_layers * 2 * block_size * s.num_kv_heads * s.head_dim * self.model.dtype.itemsize


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (quantized weights live in buffers)."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def prepare_draft(config: EngineConfig, model: torch.nn.Module, tokenizer, model_info: dict[str, Any],
                  draft: DraftModel | None = None) -> DraftModel | None:
    """The engine's draft model (None unless ``config.speculative`` names one): ``draft`` if given (a rebuilt
    engine keeps its loaded draft), else loaded from the source; checked against the target's tokenizer.
    Records the draft in ``model_info``."""
    if not is_draft_source(config.speculative):
        return None
    if draft is None:
        draft = load_draft(config.speculative, model, config)
    target_name = str(model_info.get("source", "the target model"))
    check_same_tokenizer(target_name, model, tokenizer, draft)
    model_info.update({"draft_source": draft.source, "draft_dtype": str(draft.model.dtype).removeprefix("torch."),
                       "draft_quantization": draft.info.get("quantization", "none"),
                       "draft_weight_bytes": draft.weight_bytes, "weight_bytes": module_bytes(model)})
    return draft


def load_draft(source: str, target: torch.nn.Module, config: EngineConfig) -> DraftModel:
    """Load ``source`` with the target's device and dtype (the loader used for ``model.source``)."""
    from jobrunner.models.factory import load_for_engine

    device = next(target.parameters()).device
    try:
        model, tokenizer, _, info = load_for_engine(
            source, dtype=str(target.dtype).removeprefix("torch."), device=str(device),
            quantization=config.draft_quantization, max_model_len=config.max_model_len)
    except ValueError as exc:  # ModelSourceError and the loader's own checks: name the setting
        raise ValueError(f"engine.speculative: the draft model could not be loaded: {exc}") from exc
    return DraftModel(model, tokenizer, source, info)


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of every (token string, id) pair and the special tokens: equal iff ids mean the same."""
    specials = {name: getattr(tokenizer, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id",
                                                                   "unk_token_id")}
    payload = json.dumps([sorted(tokenizer.get_vocab().items()), specials], separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def check_same_tokenizer(target_name: str, target: torch.nn.Module, target_tokenizer, draft: DraftModel) -> None:
    """ValueError naming both models when the draft's vocabulary or tokenizer differs from the target's."""
    head = (f"engine.speculative: the draft model {draft.source!r} does not share the tokenizer of the target "
            f"model {target_name!r}")
    a, b = target.shape.vocab_size, draft.model.shape.vocab_size
    if a != b:
        raise ValueError(f"{head}: vocabulary size {b} (draft) vs {a} (target)")
    fa, fb = tokenizer_fingerprint(target_tokenizer), tokenizer_fingerprint(draft.tokenizer)
    if fa != fb:
        raise ValueError(f"{head}: tokenizer fingerprint {fb} (draft) vs {fa} (target), "
                         f"{_vocab_difference(target_tokenizer, draft.tokenizer)}")


def _vocab_difference(target_tokenizer, draft_tokenizer) -> str:
    """E.g. '12 of 384 token strings map to other ids (first: 'Ġthe')', or the special tokens that differ."""
    va, vb = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    differ = sorted(t for t in set(va) | set(vb) if va.get(t) != vb.get(t))
    if differ:
        return f"{len(differ)} of {max(len(va), len(vb))} token strings map to other ids (first: {differ[0]!r})"
    return "the same vocabulary but other special tokens (bos / eos / pad / unk)"
