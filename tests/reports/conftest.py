"""Fixtures for report tests (the output-writing helpers live in report_outputs.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from report_outputs import write_job

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "reports"


@pytest.fixture
def job_factory(tmp_path: Path) -> Callable[..., str]:
    """write_job under tmp_path/<name>; returns the directory as a URL-less local path."""
    def factory(name: str = "job", **kw) -> str:
        return write_job(str(tmp_path / name), **kw)
    return factory


@pytest.fixture
def artifacts_dir() -> Path:
    """artifacts/reports at the repo root (gitignored): screenshots and pages of the browser test."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
