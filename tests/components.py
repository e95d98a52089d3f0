"""Real components the suite promises (moto's S3 server, Ray, Chromium, the SmolLM2 parity data, ...).

When one cannot start, :func:`missing_component` skips the test on a developer's machine but FAILS it under
``CI=true``: CI must never go green with the component silently gone. Only what a machine truly lacks (a GPU)
stays a plain ``pytest.skip`` / ``skipif``; `make test` shows every skip's reason (``-rs``). The native (C)
quant builds are such components too (:func:`require_native`): a compile error fails CI instead of skipping.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TypeVar

import pytest

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parents[1]


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


def require_native(what: str, build: Callable[[], T | None]) -> T:
    """A native (C) build the suite promises: ``build()``'s result, or :func:`missing_component` naming it.

    The quant package turns a missing compiler or a failed compile into ``None`` (the torch path runs, with a
    warning) so that a user's job still runs; a test of the C code must not turn that into a quiet skip, so
    under ``CI=true`` it fails with the build's warning. Native code turned off on purpose
    (``JOBRUNNER_QUANT_NATIVE=0``) is a plain skip.
    """
    import warnings

    from jobrunner.quant.int4_native import NATIVE_ENV

    if os.environ.get(NATIVE_ENV, "1").strip() == "0":
        pytest.skip(f"{NATIVE_ENV}=0: native code is turned off")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = build()
    if built is None:
        said = "; ".join(str(w.message) for w in caught) or "its warning was given earlier in this process"
        missing_component(f"the native {what} did not build (no C compiler, or a compile error): {said}")
    return built
