"""A pytest plugin for ``scripts/gpu_check.sh``: one JSON line per test outcome, written as each test ends.

    GPU_CHECK_RESULTS=$OUT/tests.jsonl PYTHONPATH=scripts:. python -m pytest -p gpu_check_results tests/gpu

``--junitxml`` is written only when pytest exits, so a stage killed by ``timeout`` loses every outcome; here
each line is flushed (and fsync'ed) at once, so what finished survives. A line: ``{"test", "outcome"
(passed|failed|error|skipped), "seconds", "message"}`` (skips carry their reason, failures the end of their
report); a collection error (a module that cannot be imported) is an ``error`` line named after the module.
"""

from __future__ import annotations

import json
import os

import pytest

_PATH_ENV = "GPU_CHECK_RESULTS"


def _write(record: dict) -> None:
    path = os.environ.get(_PATH_ENV)
    if not path:
        return
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _message(report) -> str | None:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])[:500]        # (file, line, "Skipped: reason")
    if report.failed:
        return str(report.longrepr)[-1500:]
    return None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A test's outcome: its call, or its setup when that failed or skipped, or its teardown when that failed."""
    if report.when == "call" or (report.when == "setup" and not report.passed) or (
            report.when == "teardown" and report.failed):
        outcome = report.outcome if report.when == "call" else ("skipped" if report.skipped else "error")
        _write({"test": report.nodeid, "outcome": outcome, "seconds": round(report.duration, 3),
                "message": _message(report)})


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module that fails to import: an error line (its tests never run)."""
    if report.failed:
        _write({"test": report.nodeid, "outcome": "error", "seconds": 0.0, "message": str(report.longrepr)[-1500:]})
