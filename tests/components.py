"""Real components the suite promises (moto's S3 server, Ray, Chromium, the SmolLM2 parity data, ...).

When one cannot start, :func:`missing_component` skips the test on a developer's machine but FAILS it under
``CI=true``: CI must never go green with the component silently gone. Only what a machine truly lacks (a GPU)
stays a plain ``pytest.skip`` / ``skipif``; `make test` shows every skip's reason (``-rs``).
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def is_ci() -> bool:
    """Whether this run is CI's (``CI=true``, as GitHub Actions, GitLab and most runners set it)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def missing_component(reason: str) -> NoReturn:
    """A promised component is unavailable: ``pytest.fail`` under CI, ``pytest.skip`` elsewhere."""
    if is_ci():
        pytest.fail(f"CI=true and a component the suite promises is missing: {reason}", pytrace=False)
    pytest.skip(reason)


def require_import(module: str, why: str):
    """Import ``module`` (a promised dependency), or :func:`missing_component` naming it and ``why``."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing_component(f"cannot import {module} ({exc}); {why}")
