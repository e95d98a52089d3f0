"""Whether a model source has a chat template, known without loading the tokenizer or downloading anything.

A base (pretrained) model has none: chat rows (messages, a system prompt, tools) cannot become prompts for it,
and every such row would be an error row after the worker has loaded the model. `jobrunner validate` and
`jobrunner run` ask :func:`has_chat_template` before any worker starts (driver/chat_check.py).
"""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")  # transformers' own files beside the tokenizer


def has_chat_template(source: str) -> bool | None:
    """True / False when this machine can tell from files alone; None when it cannot (a Hub id or storage URL
    not fetched yet: the worker finds out).

    An alias: its converted copy in the cache when there is one, else what the alias declares
    (``GGUFFixups.has_chat_template``). A local directory (or ``file://`` URL): its ``tokenizer_config.json``
    (``chat_template``) or a ``chat_template.jinja`` / ``chat_template.json`` file.
    """
    from jobrunner.models.sources import ALIASES, cache_root

    source = source.strip()
    if source in ALIASES:
        cached = directory_has_chat_template(cache_root() / "models" / source)
        return ALIASES[source].fixups.has_chat_template if cached is None else cached
    if source.startswith("file://"):
        source = source[len("file://"):]
    if "://" in source:
        return None
    return directory_has_chat_template(Path(source).expanduser())


def directory_has_chat_template(path: Path) -> bool | None:
    """Whether a local model directory's tokenizer has a chat template; None without tokenizer_config.json."""
    if not path.is_dir():
        return None
    if any((path / name).is_file() for name in TEMPLATE_FILES):
        return True
    config = path / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        template = json.loads(config.read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    return bool(template)
