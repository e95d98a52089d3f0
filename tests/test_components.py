"""The promise of tests/components.py: a component the suite needs that is missing (here the native quant build,
broken on purpose with a compiler that always fails) fails the run under CI=true and is a skip elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.components import REPO_ROOT, require_native

NATIVE_TEST = "tests/quant/test_dispatch.py::test_native_int4_unpack_matches_torch"


def test_require_native_fails_under_ci_skips_elsewhere_and_honours_the_off_switch(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="the native C loop did not build"):
        require_native("C loop", lambda: None)
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="the native C loop did not build"):
        require_native("C loop", lambda: None)
    monkeypatch.setenv("JOBRUNNER_QUANT_NATIVE", "0")  # turned off on purpose: a skip even under CI
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.skip.Exception, match="native code is turned off"):
        require_native("C loop", lambda: None)
    monkeypatch.delenv("JOBRUNNER_QUANT_NATIVE")
    assert require_native("C loop", lambda: "built") == "built"


def test_a_compile_error_fails_the_native_tests_under_ci(tmp_path):
    """The real build with CC=false (every compile fails) and an empty build cache, in a child pytest."""
    env = {**os.environ, "CC": "false", "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)}
    env.pop("JOBRUNNER_QUANT_NATIVE", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", NATIVE_TEST]
    ci = subprocess.run(cmd, cwd=REPO_ROOT, env={**env, "CI": "true"}, capture_output=True, text=True,
                        timeout=300)
    assert ci.returncode == 1, ci.stdout + ci.stderr
    assert "2 failed" in ci.stdout and "the native int4 unpack did not build" in ci.stdout, ci.stdout
    local = subprocess.run(cmd, cwd=REPO_ROOT, env={**env, "CI": ""}, capture_output=True, text=True, timeout=300)
    assert local.returncode == 0 and "2 skipped" in local.stdout, local.stdout + local.stderr
