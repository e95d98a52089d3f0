"""The promise of tests/components.py: a component the suite needs that is missing fails the run under `make test`
(JOBRUNNER_TESTS_STRICT=1) or CI=true and is a skip elsewhere; a native build broken on purpose (a compiler that
always fails) fails everywhere."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.components import REPO_ROOT, STRICT_ENV, missing_component, require_library, require_native

NATIVE_TEST = "tests/quant/test_dispatch.py::test_native_int4_unpack_matches_torch"


def test_a_missing_component_fails_under_make_test_or_ci_and_skips_elsewhere(monkeypatch):
    for ci, strict, outcome in [("true", "", pytest.fail.Exception), ("", "1", pytest.fail.Exception),
                                ("", "", pytest.skip.Exception)]:
        monkeypatch.setenv("CI", ci)
        monkeypatch.setenv(STRICT_ENV, strict)
        with pytest.raises(outcome, match="moto is gone"):
            missing_component("moto is gone")


def test_a_failed_native_build_fails_everywhere_and_honours_the_off_switch(monkeypatch):
    monkeypatch.setenv(STRICT_ENV, "")
    for ci in ("true", ""):
        monkeypatch.setenv("CI", ci)
        with pytest.raises(pytest.fail.Exception, match="the native C loop did not build"):
            require_native("C loop", lambda: None)
        with pytest.raises(pytest.fail.Exception, match="packed GEMM unavailable"):
            require_library("packed GEMM unavailable (cc: error)")
    with pytest.raises(pytest.skip.Exception, match="the OS refused the AMX tile state"):  # the kernel built
        require_library("AMX GEMM unavailable (the OS refused the AMX tile state)")
    monkeypatch.setenv("JOBRUNNER_QUANT_NATIVE", "0")  # turned off on purpose: a skip even under CI
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.skip.Exception, match="native code is turned off"):
        require_native("C loop", lambda: None)
    monkeypatch.delenv("JOBRUNNER_QUANT_NATIVE")
    assert require_native("C loop", lambda: "built") == "built"


def test_a_compile_error_fails_the_native_tests_with_or_without_ci(tmp_path):
    """The real build with CC=false (every compile fails) and an empty build cache, in a child pytest."""
    env = {**os.environ, "CC": "false", "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)}
    env.pop("JOBRUNNER_QUANT_NATIVE", None)
    env.pop(STRICT_ENV, None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", NATIVE_TEST]
    local = subprocess.run(cmd, cwd=REPO_ROOT, env={**env, "CI": ""}, capture_output=True, text=True, timeout=300)
    assert local.returncode == 1, local.stdout + local.stderr
    assert "2 failed" in local.stdout and "the native int4 unpack did not build" in local.stdout, local.stdout
