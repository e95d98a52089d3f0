"""Storage retries: transient errors are retried with backoff, then reported naming the operation."""

from __future__ import annotations

import pytest

from jobrunner.io.storage import StorageError, retry


def test_transient_errors_are_retried_then_succeed():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("connection reset")
        return "ok"

    assert retry("read s3://b/k", flaky, attempts=4, backoff_s=0.001) == "ok"
    assert len(calls) == 3


def test_persistent_errors_name_the_url_and_permanent_ones_are_not_retried():
    def down():
        raise TimeoutError("timed out")

    with pytest.raises(StorageError, match=r"write s3://b/k: failed after 2 attempts: TimeoutError"):
        retry("write s3://b/k", down, attempts=2, backoff_s=0.001)
    calls = []

    def missing():
        calls.append(1)
        raise FileNotFoundError("no such key")

    with pytest.raises(FileNotFoundError, match="read s3://b/x: no such key"):
        retry("read s3://b/x", missing, attempts=3, backoff_s=0.001)
    assert len(calls) == 1
