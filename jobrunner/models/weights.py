"""Read config, tokenizer and weights from a local Hugging Face model directory.

Weights stream one tensor at a time (`safetensors.safe_open`, memory-mapped), so a loader can copy each into
its own (possibly sharded or quantized) parameter without ever holding two full copies of the model. Pickle
checkpoints (`*.bin`) are read only when the caller opts in, and then with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"


def load_config(model_dir: str | Path) -> PretrainedConfig:
    """The model's transformers config (never runs code shipped with the model)."""
    return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)


def load_tokenizer(model_dir: str | Path):
    """The model's fast tokenizer (never runs code shipped with the model)."""
    return AutoTokenizer.from_pretrained(str(model_dir), use_fast=True, trust_remote_code=False)


def iter_safetensors(
    model_dir: str | Path, *, allow_pickle: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` lazily from a single or sharded (index.json) safetensors checkpoint.

    A directory without safetensors falls back to its pickle `*.bin` files only when `allow_pickle` is set.
    """
    model_dir = Path(model_dir)
    files = safetensors_files(model_dir)
    if not files:
        if allow_pickle:
            yield from iter_pickle(model_dir)
            return
        raise FileNotFoundError(
            f"{model_dir} has no *.safetensors weights (pickle *.bin files need allow_pickle=True)"
        )
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


class Checkpoint:
    """A model directory's weights as ``(name, tensor)`` pairs that also names its tensors up front
    (:meth:`names`, from the safetensors headers alone), so a streamed load knows when each layer is complete.

    Tensors are memory-mapped views of the shard files (zero-copy: reading one costs page cache, not the
    process's own memory). Pickle ``*.bin`` files (``allow_pickle``) have no names up front: :meth:`names`
    is None and each file is unpickled whole, one at a time.
    """

    def __init__(self, model_dir: str | Path, *, allow_pickle: bool = False) -> None:
        self.model_dir = Path(model_dir)
        self.allow_pickle = allow_pickle
        self.files = safetensors_files(self.model_dir)

    def names(self) -> list[str] | None:
        """Every tensor name in file order, or None for a pickle checkpoint."""
        if not self.files:
            return None
        names: list[str] = []
        for path in self.files:
            with safe_open(str(path), framework="pt") as handle:
                names += list(handle.keys())
        return names

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter_safetensors(self.model_dir, allow_pickle=self.allow_pickle)


def iter_pickle(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` from `pytorch_model*.bin` files, unpickling tensors only (weights_only=True)."""
    model_dir = Path(model_dir)
    files = _indexed_files(model_dir, PICKLE_INDEX) or sorted(model_dir.glob("*.bin"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.bin files")
    for path in files:
        state_dict = torch.load(str(path), map_location="cpu", weights_only=True)
        yield from state_dict.items()
        del state_dict


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: those named in the shard index if there is one, else all."""
    return _indexed_files(model_dir, SAFETENSORS_INDEX) or sorted(model_dir.glob("*.safetensors"))


def _indexed_files(model_dir: Path, index_name: str) -> list[Path]:
    """Files named by a sharded checkpoint's `weight_map`, in order; [] without an index."""
    index_path = model_dir / index_name
    if not index_path.is_file():
        return []
    weight_map = json.loads(index_path.read_text())["weight_map"]
    names = sorted(set(weight_map.values()))
    missing = [n for n in names if not (model_dir / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{index_path} names missing shard files: {missing}")
    return [model_dir / n for n in names]
