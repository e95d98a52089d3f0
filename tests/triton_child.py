"""Triton kernels tested on the CPU: a parent test reruns its own file's selected tests in a child process with
``TRITON_INTERPRET=1`` (the interpreter must be chosen before triton is imported), and those tests skip in the
parent through the ``interpreted`` fixture a test file builds with :func:`interpreted_fixture`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.components import require_import


def in_child(flag: str) -> bool:
    """Whether this process is the interpreter child that sets ``flag``."""
    return os.environ.get(flag) == "1" and os.environ.get("TRITON_INTERPRET") == "1"


def interpreted_fixture(flag: str):
    """A fixture that skips outside the interpreter child (the parent test runs those tests there)."""

    @pytest.fixture
    def interpreted():
        """Only in the child process, where every Triton kernel is interpreted on the CPU."""
        if not in_child(flag):
            pytest.skip("runs in the TRITON_INTERPRET=1 child of test_kernels_under_the_triton_interpreter")
        pytest.importorskip("triton")

    return interpreted


def run_in_interpreter_child(test_file: str, flag: str, select: str, why: str, drop_env: tuple[str, ...] = ()) -> str:
    """Run ``test_file``'s tests matching ``-k select`` under the interpreter; they must all pass (or xfail as
    marked), none skip. Returns the child's output, whose summary line a caller may check further."""
    require_import("triton", why)
    env = dict(os.environ, TRITON_INTERPRET="1", **{flag: "1"})
    for name in drop_env:
        env.pop(name, None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", select, str(Path(test_file))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-3000:]
    return proc.stdout
