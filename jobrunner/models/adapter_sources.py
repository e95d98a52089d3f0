"""Turn a LoRA adapter *source* (local dir, ``file://`` URL, storage URL, Hub id) into a local PEFT directory.

Fetched like models (:mod:`jobrunner.models.sources`): a storage URL is copied once into the cache by
:mod:`jobrunner.io.model_fetch` (the only storage access), a Hub id is a snapshot of the adapter's files only.
Whatever comes back holds ``adapter_config.json`` and ``adapter_model.safetensors``.
"""

from __future__ import annotations

from pathlib import Path

from jobrunner.models.lora_files import CONFIG_FILE, WEIGHTS_FILE
from jobrunner.models.sources import _HUB_ID, _URL, ModelSourceError, _hub_offline, cache_root

ADAPTER_PATTERNS = [CONFIG_FILE, WEIGHTS_FILE]


def resolve_adapter_dir(name: str, source: str, *, cache_dir: str | None = None, revision: str | None = None,
                        storage_options: dict | None = None) -> Path:
    """A local directory holding adapter ``name``'s PEFT files; ModelSourceError naming the adapter and source."""
    if not isinstance(source, str) or not source.strip():
        raise ModelSourceError(f"adapter {name!r}: the source must be a non-empty string, got {source!r}")
    source = source.strip()
    if source.startswith("file://"):
        return check_adapter_dir(name, source, Path(source[len("file://"):]))
    if _URL.match(source):
        return _fetch_url(name, source, cache_dir, storage_options)
    local = Path(source).expanduser()
    if local.exists():
        return check_adapter_dir(name, source, local)
    if _HUB_ID.match(source):
        return _fetch_hub(name, source, revision, cache_dir)
    raise ModelSourceError(f"adapter {name!r}: source {source!r} is not an existing directory, a storage URL "
                           "(s3://..., file://...) or a Hugging Face Hub id (org/name)")


def check_adapter_source(name: str, source: str) -> str:
    """What adapter ``name``'s source is, checked without fetching: a local directory's files and config
    (refusing what the engine would refuse); a storage URL or Hub id by its form only (each worker fetches it)."""
    from jobrunner.models.lora_files import read_adapter_config

    path = source[len("file://"):] if source.startswith("file://") else source
    if source.startswith("file://") or (not _URL.match(source) and Path(path).expanduser().exists()):
        local = check_adapter_dir(name, source, Path(path).expanduser())
        config = read_adapter_config(name, local)
        return f"local directory {local} (r={config.get('r')}, lora_alpha={config.get('lora_alpha')})"
    if _URL.match(source):
        return f"storage URL {source} (fetched by each worker)"
    if _HUB_ID.match(source):
        return f"Hugging Face Hub id {source!r} (form checked; downloaded by each worker)"
    raise ModelSourceError(f"adapter {name!r}: source {source!r} is not an existing directory, a storage URL "
                           "(s3://..., file://...) or a Hugging Face Hub id (org/name)")


def check_adapter_dir(name: str, source: str, path: Path) -> Path:
    """``path`` resolved if it holds a PEFT adapter's config and safetensors weights."""
    if not path.is_dir():
        raise ModelSourceError(f"adapter {name!r}: source {source!r}: {path} is not a directory")
    missing = [f for f in ADAPTER_PATTERNS if not (path / f).is_file()]
    if missing:
        raise ModelSourceError(f"adapter {name!r}: source {source!r}: {path} has no {', '.join(missing)} "
                               "(a PEFT LoRA adapter saved with save_pretrained)")
    return path.resolve()


def _fetch_url(name: str, source: str, cache_dir: str | None, storage_options: dict | None) -> Path:
    from jobrunner.io.model_fetch import fetch_model_dir

    try:
        local = fetch_model_dir(source, storage_options, cache_root(cache_dir) / "remote",
                                patterns=ADAPTER_PATTERNS, required=CONFIG_FILE)
    except Exception as exc:  # unknown protocol, missing bucket, credentials, network, no adapter_config.json
        raise ModelSourceError(f"adapter {name!r}: source {source!r}: could not copy the adapter directory: "
                               f"{type(exc).__name__}: {exc}") from exc
    return check_adapter_dir(name, source, local)


def _fetch_hub(name: str, repo_id: str, revision: str | None, cache_dir: str | None) -> Path:
    offline = _hub_offline()
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo_id, revision=revision, allow_patterns=ADAPTER_PATTERNS,
                                 cache_dir=str(cache_root(cache_dir) / "hub") if cache_dir else None,
                                 local_files_only=offline)
    except Exception as exc:  # network errors, missing or gated repo, empty offline cache
        where = "in the local Hugging Face cache (HF_HUB_OFFLINE is set)" if offline else "on the Hub"
        raise ModelSourceError(f"adapter {name!r}: source {repo_id!r}: not a local directory, and the Hub id "
                               f"could not be found {where}: {type(exc).__name__}: {exc}") from exc
    return check_adapter_dir(name, repo_id, Path(path))
