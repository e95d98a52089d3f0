"""Convert a GGUF checkpoint into a Hugging Face directory (safetensors + tokenizer).

The conversion dequantizes every tensor to float32 through transformers' GGUF loader, so the engine only ever
reads one format. It is slow (tens of seconds) and writes wherever it is told: the caller
(`jobrunner.models.sources`) runs it once, into a temporary directory that is renamed into the cache when
complete, under a file lock.

Imports only torch, transformers and the `gguf` package (the latter lazily, for the chat template fallback).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import torch

# The converter's own code: a hash of these files (with the fix-ups and the transformers version that does the
# dequantization) is written into the converted directory and read back by `conversion_is_current`, so any
# change to the conversion rebuilds every cached conversion on its next use, with no version number to bump.
CONVERTER_SOURCES: tuple[Path, ...] = (Path(__file__),)
MARKER_FILE = "jobrunner_conversion.json"


@dataclass(frozen=True)
class GGUFFixups:
    """Corrections for a known GGUF file, stated explicitly rather than guessed from its name.

    `eos_token`: the token that ends an assistant turn. Some GGUF exports record `<|im_start|>` as EOS;
    the original Hugging Face release of the same model stops on `<|im_end|>`.

    `has_chat_template`: False for a pretrained (not instruction-tuned) export that carries no chat template
    (Gemma 3 270M): the directory then has none either, rather than a guessed one; its jobs use prompt rows, or
    give a template in `input.chat_template`.
    """

    eos_token: str | None = None
    has_chat_template: bool = True


def convert_gguf(gguf_path: Path, out_dir: Path, fixups: GGUFFixups | None = None) -> None:
    """Write config.json, generation_config.json, float32 *.safetensors and tokenizer files to `out_dir`.

    `out_dir` must exist and be empty. Raises RuntimeError if neither the tokenizer nor the GGUF metadata has
    a chat template, unless `fixups.has_chat_template` is False.
    """
    fixups = fixups or GGUFFixups()
    model = _load_model(gguf_path)
    _drop_gguf_quantizer(model)
    tokenizer = _load_tokenizer(gguf_path)
    if fixups.eos_token is not None:
        _set_eos(model, tokenizer, fixups.eos_token)
    if not getattr(tokenizer, "chat_template", None) and fixups.has_chat_template:
        tokenizer.chat_template = read_gguf_chat_template(gguf_path)
    _save_model(model, out_dir)
    tokenizer.save_pretrained(str(out_dir))
    _write_marker(gguf_path, out_dir, fixups)


def _load_model(gguf_path: Path) -> torch.nn.Module:
    """Dequantize the GGUF weights into a float32 transformers model on CPU."""
    from transformers import AutoModelForCausalLM

    # transformers renamed `torch_dtype` to `dtype` (4.56); use whichever this version knows.
    params = inspect.signature(AutoModelForCausalLM.from_pretrained).parameters
    dtype_kw = "torch_dtype" if "torch_dtype" in params else "dtype"
    return AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, **{dtype_kw: torch.float32}
    )


def _drop_gguf_quantizer(model: torch.nn.Module) -> None:
    """Forget that the weights came from a GGUF file, once we know they are dense float32.

    transformers >= 5 keeps its GGUF "quantizer" attached even after dequantizing every tensor, and then
    refuses to save_pretrained. The tensors are plain float32 by now, so the marker is all that is left.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    dtypes = {t.dtype for t in model.parameters()} | {t.dtype for t in model.buffers()}
    if dtypes - {torch.float32}:
        raise RuntimeError(f"GGUF weights were not fully dequantized (dtypes {sorted(map(str, dtypes))})")
    quantizer.remove_quantization_config(model)


def _load_tokenizer(gguf_path: Path):
    """Build the fast tokenizer that the GGUF metadata describes."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _set_eos(model: torch.nn.Module, tokenizer, eos_token: str) -> None:
    """Make `eos_token` the end-of-sequence token of the tokenizer, config and generation config."""
    eos_id = tokenizer.convert_tokens_to_ids(eos_token)
    if eos_id is None or eos_id == tokenizer.unk_token_id:
        raise RuntimeError(f"GGUF fix-up: token {eos_token!r} is not in the vocabulary")
    tokenizer.eos_token = eos_token
    model.config.eos_token_id = eos_id
    if model.generation_config is not None:
        model.generation_config.eos_token_id = eos_id
        model.generation_config.pad_token_id = eos_id


def _save_model(model: torch.nn.Module, out_dir: Path) -> None:
    """Save as safetensors (transformers >= 5 always does; older versions need the flag)."""
    params = inspect.signature(model.save_pretrained).parameters
    extra = {"safe_serialization": True} if "safe_serialization" in params else {}
    model.save_pretrained(str(out_dir), **extra)
    if not any(out_dir.glob("*.safetensors")):
        raise RuntimeError(f"GGUF conversion wrote no .safetensors file into {out_dir}")


def read_gguf_chat_template(gguf_path: Path) -> str:
    """Return `tokenizer.chat_template` from the GGUF metadata (RuntimeError if absent)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    field = reader.fields.get("tokenizer.chat_template")
    if field is None:
        raise RuntimeError(f"{gguf_path} has no tokenizer.chat_template in its metadata")
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def conversion_is_current(gguf_path: Path, out_dir: Path, fixups: GGUFFixups | None = None) -> bool:
    """Whether `out_dir` was converted from this GGUF file (name, size, content hash) by this converter code
    with these fix-ups (see CONVERTER_SOURCES).

    A directory without a readable marker (an older converter, a crash, a hand-made copy) is not current.
    """
    try:
        marker = json.loads((out_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker == _marker(gguf_path, fixups)


def converter_fingerprint(fixups: GGUFFixups | None = None) -> str:
    """sha256 over the converter's source files, the fix-ups and the transformers version (its GGUF loader
    dequantizes the weights)."""
    import transformers

    digest = hashlib.sha256()
    for path in CONVERTER_SOURCES:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(repr(fixups or GGUFFixups()).encode() + b"\0" + transformers.__version__.encode())
    return digest.hexdigest()


def _marker(gguf_path: Path, fixups: GGUFFixups | None) -> dict:
    stat = gguf_path.stat()
    return {
        "converter_sha256": converter_fingerprint(fixups),
        "gguf_file": gguf_path.name,
        "gguf_size": stat.st_size,
        "gguf_sha256": _file_sha256(str(gguf_path), stat.st_size, stat.st_mtime_ns),
    }


@functools.lru_cache(maxsize=8)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    """The file's sha256 (about 0.3 s for the packaged 98 MB GGUF), computed once per process for an unchanged
    file (size and mtime are part of the cache key)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _write_marker(gguf_path: Path, out_dir: Path, fixups: GGUFFixups | None = None) -> None:
    """Record where the directory came from; `conversion_is_current` reads it to decide on a rebuild."""
    (out_dir / MARKER_FILE).write_text(json.dumps(_marker(gguf_path, fixups), indent=2) + "\n")
