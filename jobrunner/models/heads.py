"""What a checkpoint puts on top of its decoder, and how its embeddings are pooled.

A family's decoder (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...) comes with one of three heads, read from
the architecture name as transformers writes it: ``...ForCausalLM`` (the LM head), ``...ForSequenceClassification``
(a ``score`` linear layer, one output per label, read on the last token) or ``...Model`` (none: the bare
decoder, as ``AutoModel`` saves it, its weights without the ``model.`` prefix).

Pooling follows sentence-transformers where the model directory has its ``modules.json`` (a ``Pooling`` module
whose ``config.json`` sets ``pooling_mode_*``; a ``Normalize`` module after it); otherwise a decoder's
embedding is its last token's hidden state, not normalised.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HEAD_SUFFIXES = (("ForSequenceClassification", "classifier"), ("ForCausalLM", "lm"), ("Model", "none"))
# sentence-transformers' pooling_mode_* keys -> our pooling names
_ST_POOLING = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


def split_architecture(arch: str) -> tuple[str, str]:
    """``(the family's causal-LM architecture, head)``: head ``lm`` | ``classifier`` | ``none``."""
    for suffix, head in HEAD_SUFFIXES:
        if arch.endswith(suffix) and len(arch) > len(suffix):
            return arch[:-len(suffix)] + "ForCausalLM", head
    return arch, "lm"


def label_names(config: Any) -> list[str]:
    """A classifier's label names in output order (config ``id2label``; ``LABEL_i`` where it has none)."""
    num_labels = int(getattr(config, "num_labels", 0) or 0)
    id2label = getattr(config, "id2label", None) or {}
    return [str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(num_labels)]


def pooling_config(model_dir: str | Path) -> dict[str, Any]:
    """``{"pooling": last|mean|cls, "normalize": bool, "pooling_source": why}`` for the model in ``model_dir``.

    Raises ValueError naming the file for a sentence-transformers pooling mode we do not compute.
    """
    model_dir = Path(model_dir)
    modules = _read_json(model_dir / "modules.json")
    if not isinstance(modules, list):
        return {"pooling": "last", "normalize": False, "pooling_source": "decoder default (last token)"}
    types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
    normalize = any(t.endswith(".Normalize") for t in types)
    pool = next((m for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling")), None)
    if pool is None:
        return {"pooling": "last", "normalize": normalize, "pooling_source": "modules.json (no Pooling module)"}
    path = model_dir / str(pool.get("path", "1_Pooling")) / "config.json"
    settings = _read_json(path) or {}
    bad = [k for k in _ST_UNSUPPORTED if settings.get(k)]
    if bad:
        raise ValueError(f"{path}: {bad[0]} is not supported; supported pooling: last token, mean, cls")
    modes = [ours for key, ours in _ST_POOLING.items() if settings.get(key)]
    if len(modes) != 1:
        raise ValueError(f"{path}: expected exactly one of {', '.join(_ST_POOLING)} set, got {modes or 'none'}")
    return {"pooling": modes[0], "normalize": normalize, "pooling_source": f"{path.parent.name}/config.json"}


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
