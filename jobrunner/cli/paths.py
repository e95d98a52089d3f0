"""What a relative local path in a spec is relative to, said in the error that names it."""

from __future__ import annotations

import os
from typing import Any


def is_relative_local(url: str) -> bool:
    """A local path that is neither absolute nor a URL (``file://``, ``s3://``, ...)."""
    return "://" not in url and not os.path.isabs(os.path.expanduser(url))


def relative_path_note(spec: Any, message: str) -> str:
    """A note for an error message that names input.url or output.url when that path is relative: it is read
    from the current directory of the `jobrunner` process (not the spec file's directory)."""
    notes = []
    for field, url in (("input.url", spec.input.url), ("output.url", spec.output.url)):
        if is_relative_local(url) and (field in message or url in message):
            notes.append(f"{field} {url!r} is a relative path: it is read from the current directory "
                         f"({os.getcwd()}), not from the spec file's directory")
    return "".join(f"\n  note: {n}" for n in notes)
