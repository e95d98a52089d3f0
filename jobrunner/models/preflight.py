"""Check a model from its ``config.json`` alone, before any weight is downloaded or any worker starts.

``jobrunner validate`` and ``jobrunner run`` call :func:`preflight`: it reads only the config (a local directory's
file; one small object from a storage URL; one file from the Hugging Face Hub), then builds our model for it on
the ``meta`` device — no memory, no weights — so everything that would refuse the model at load refuses it here:
an architecture our engine does not serve, a rope scaling or window it cannot follow, a config it cannot read.
It also reports the parameter count and weight bytes (all experts included) and the context length a worker
will use, and refuses an ``engine.max_model_len`` beyond the model's own limit.
"""

from __future__ import annotations

import json
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from jobrunner.models.sources import (
    _HUB_ID,
    _URL,
    ALIASES,
    ModelSourceError,
    _hub_offline,
    cache_root,
)

BYTES_PER_WEIGHT = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "int8_weight_only": 1, "fp8": 1, "w8a8": 1,
                    "int4": 0.5}


@dataclass(frozen=True)
class ModelCheck:
    """What the config says, once checked."""

    architecture: str
    num_params: int
    context: int  # the tokens a sequence may hold in a worker (prompt + output)
    where: str  # where the config was read
    checkpoint_quant: Any = None  # a pre-quantized checkpoint's format (quant.prequantized.CheckpointQuant)
    config: Any = field(default=None, repr=False, compare=False)  # the transformers config (validate's fit)

    def describe(self, dtype: str, quantization: str) -> str:
        """One line for ``validate``: architecture, size, context (and a pre-quantized checkpoint's format).
        ``ValueError`` when ``quantization`` conflicts with the checkpoint's own."""
        found = self.checkpoint_quant
        if found is not None:
            from jobrunner.quant.prequantized import resolve_scheme

            quantization = resolve_scheme(quantization, found)
        stored = quantization if quantization != "none" else dtype
        widths = [("bfloat16", 2), ("float32", 4)] if stored == "auto" else [(stored, BYTES_PER_WEIGHT[stored])]
        sizes = " or ".join(f"{self.num_params * width / 1e9:.2f} GB as {name}" for name, width in widths)
        loaded = f"; pre-quantized checkpoint: {found.describe()}, loaded as it is" if found is not None else ""
        return (f"{self.architecture}, {self.num_params / 1e6:,.1f} M parameters (weights: {sizes}), context "
                f"{self.context:,} tokens{loaded}; config read from {self.where}, nothing else downloaded")


def preflight(source: str, max_model_len: int | None = None, revision: str | None = None,
              storage_options: dict | None = None) -> ModelCheck | None:
    """Check ``source`` from its config alone; None for an alias whose GGUF is not converted yet (its
    architecture is ours by construction). Raises ModelSourceError naming the problem."""
    found = read_config(source, revision, storage_options)
    if found is None:
        return None
    config, where = found
    return check_config(config, max_model_len, where)


def read_config(source: str, revision: str | None = None,
                storage_options: dict | None = None) -> tuple[Any, str] | None:
    """The transformers config of ``source`` and where it was read, reading nothing but ``config.json``."""
    from transformers import AutoConfig

    source = source.strip()
    if source in ALIASES:  # our own aliases: the config of an earlier conversion, if there is one
        converted = cache_root() / "models" / source
        if not (converted / "config.json").is_file():
            return None
        return AutoConfig.from_pretrained(str(converted)), f"the converted alias ({converted})"
    if source.startswith("file://"):
        source = source[len("file://"):]
    if _URL.match(source):
        return _config_from_text(_read_url_config(source, storage_options), source), f"{source.rstrip('/')}/config.json"
    local = Path(source).expanduser()
    if local.exists():
        return AutoConfig.from_pretrained(str(local), trust_remote_code=False), str(local / "config.json")
    if _HUB_ID.match(source):
        return _hub_config(source, revision)
    raise ModelSourceError(f"model source {source!r}: no config.json to check")


def check_config(config: Any, max_model_len: int | None, where: str = "config.json") -> ModelCheck:
    """Build our model for ``config`` on the meta device (what a worker's load would refuse, refused here) and
    work out the context a worker uses."""
    import torch

    from jobrunner.models.loader import build_model, check_architecture
    from jobrunner.quant.prequantized import read_checkpoint_quant

    try:
        arch = check_architecture(config)
        model = build_model(config, torch.float32, torch.device("meta"), None)
        found = read_checkpoint_quant(getattr(config, "quantization_config", None))  # refused as a load would
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise ModelSourceError(f"{where}: {exc}") from None
    num_params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    limit = int(getattr(config, "max_position_embeddings", 0) or 0)
    if max_model_len is not None and limit and max_model_len > limit:
        raise ModelSourceError(f"engine.max_model_len={max_model_len} is longer than the model's "
                               f"max_position_embeddings={limit} ({where}); set it to {limit} or less")
    return ModelCheck(arch, num_params, min(limit, max_model_len) if max_model_len and limit else limit, where,
                      found, config)


def _config_from_text(text: str, source: str) -> Any:
    from transformers import AutoConfig

    try:
        json.loads(text)
    except ValueError as exc:
        raise ModelSourceError(f"model source {source!r}: config.json is not valid JSON ({exc})") from None
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(text)
        return AutoConfig.from_pretrained(tmp, trust_remote_code=False)


def _read_url_config(url: str, storage_options: dict | None) -> str:
    from jobrunner.io.model_fetch import read_config_text

    try:
        return read_config_text(url, storage_options)
    except Exception as exc:  # noqa: BLE001 - unknown protocol, missing bucket, credentials, no config.json
        raise ModelSourceError(f"model source {url!r}: {type(exc).__name__}: {exc}") from exc


class ConfigUnavailable(Exception):
    """The config cannot be read from here (e.g. no route to the Hub): not checked, not refused."""


def _hub_config(repo_id: str, revision: str | None) -> tuple[Any, str]:
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = _hub_offline()
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    if not offline and not _resolves(host):  # no network: say so at once (the client retries for ~25 s)
        raise ConfigUnavailable(f"the Hugging Face Hub ({host}) cannot be reached from here")
    try:
        path = hf_hub_download(repo_id, "config.json", revision=revision, local_files_only=offline)
    except LocalEntryNotFoundError as exc:
        if not offline:
            raise ConfigUnavailable(f"the Hugging Face Hub ({host}) did not answer: {exc}") from None
        raise ModelSourceError(f"model source {repo_id!r}: cannot read its config.json from the Hugging Face Hub "
                               "(HF_HUB_OFFLINE is set and the local cache has no config.json for it)") from None
    except Exception as exc:  # noqa: BLE001 - no such repo, gated, private, bad revision: say which and why
        raise ModelSourceError(f"model source {repo_id!r}: cannot read its config.json from the Hugging Face "
                               f"Hub: {type(exc).__name__}: {exc}") from None
    return _config_from_text(Path(path).read_text(), repo_id), f"the Hugging Face Hub ({repo_id}/config.json)"


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return False
    return True
