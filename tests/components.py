"""Real components the suite promises (moto's S3 server, Ray, Chromium, vLLM's venv, gguf, triton, ...).

When one cannot start, :func:`missing_component` skips the test on a developer's machine (``python -m pytest``
on a part) but FAILS it under ``make test`` / ``make test-heavy`` (which install every component and set
``JOBRUNNER_TESTS_STRICT=1``) and under ``CI=true``: a run of the suite never goes green with a component
silently gone. Only what a machine truly lacks (a GPU, a CPU capability) stays a plain ``pytest.skip``;
`make test` shows every skip's reason (``-rs``).

Native (C) kernels are stricter still (:func:`native_build_failed`, :func:`require_library`,
:func:`require_native`): on a CPU that has what a kernel needs, a kernel that does not build or load FAILS,
anywhere, CI or not; it skips only where the CPU lacks the capability (:func:`cpu_lacks`), where the OS refuses
the AMX tile state, or where native code is turned off on purpose.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TypeVar

import pytest

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parents[1]
STRICT_ENV = "JOBRUNNER_TESTS_STRICT"  # set by the Makefile's test targets: every component is installed there
OS_REFUSED_AMX = "the OS refused the AMX tile state"  # jobrunner/kernels/build.py's reason: not a build failure


def is_ci() -> bool:
    """Whether this run is CI's (``CI=true``, as GitHub Actions, GitLab and most runners set it)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def is_strict() -> bool:
    """Whether a missing component fails the test: under ``make test`` / ``make test-heavy`` or CI."""
    return is_ci() or os.environ.get(STRICT_ENV, "").strip() == "1"


def missing_component(reason: str) -> NoReturn:
    """A promised component is unavailable: ``pytest.fail`` under `make test` or CI, ``pytest.skip`` elsewhere."""
    if is_strict():
        why = "CI=true" if is_ci() else f"{STRICT_ENV}=1 (make test installs it)"
        pytest.fail(f"{why} and a component the suite promises is missing: {reason}", pytrace=False)
    pytest.skip(reason)


def cpu_lacks(capability: str) -> str | None:
    """Why this machine's CPU lacks ``capability`` (``avx2``, ``avx512``, ``avx512_bf16``, ``amx``), or None when
    it has it: the CPU itself (torch's probes), never a capability forced with ``JOBRUNNER_CPU_CAPABILITY``."""
    import torch

    base = torch.backends.cpu.get_cpu_capability().lower()
    has = {"avx2": base.startswith(("avx2", "avx512")), "avx512": base.startswith("avx512"),
           "avx512_bf16": base.startswith("avx512") and torch.cpu._is_avx512_bf16_supported(),
           "amx": base.startswith("avx512") and torch.cpu._is_amx_tile_supported()}[capability]
    return None if has else f"this CPU has no {capability} (torch reports {base})"


def require_cpu(capability: str) -> None:
    """Skip unless this machine's CPU has ``capability`` (:func:`cpu_lacks`): what a machine truly lacks."""
    lacking = cpu_lacks(capability)
    if lacking:
        pytest.skip(lacking)


def native_build_failed(reason: str) -> NoReturn:
    """A native kernel did not build or load on a CPU that has what it needs: a FAILURE, CI or not (a broken
    build must never read as a skip). The OS refusing the AMX tile state is a skip: the kernel built."""
    if OS_REFUSED_AMX in reason:
        pytest.skip(reason)
    pytest.fail(f"a native kernel did not build or load on a CPU that can run it: {reason}", pytrace=False)


def require_library(lib: T | str) -> T:
    """A loaded native library, or :func:`native_build_failed` with the reason the loader gave (a str)."""
    if isinstance(lib, str):
        native_build_failed(lib)
    return lib


def require_import(module: str, why: str):
    """Import ``module`` (a promised dependency), or :func:`missing_component` naming it and ``why``."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing_component(f"cannot import {module} ({exc}); {why}")


def require_native(what: str, build: Callable[[], T | None]) -> T:
    """A native (C) quant build the suite promises: ``build()``'s result, or :func:`native_build_failed` naming
    it.

    The quant package turns a missing compiler or a failed compile into ``None`` (the torch path runs, with a
    warning) so that a user's job still runs; a test of the C code must not turn that into a quiet skip, so it
    fails with the build's warning, CI or not. Native code turned off on purpose (``JOBRUNNER_QUANT_NATIVE=0``)
    is a plain skip.
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
        native_build_failed(f"the native {what} did not build (no C compiler, or a compile error): {said}")
    return built
