"""The reader projects the metric columns and streams batches: memory does not grow with the output."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from report_outputs import make_manifest, make_rows, write_outputs

from jobrunner.io.report_reader import METRIC_COLUMNS, iter_metric_batches, open_outputs
from jobrunner.reports import load_report

ROWS, TEXT_CHARS = 20_000, 2_000  # 40 MB of generated_text that a report must never decode
_KEEP_ALIVE: list[pa.MemoryPool] = []  # buffers allocated through a proxy pool may outlive the test


@pytest.fixture(scope="module")
def wide_job(tmp_path_factory: pytest.TempPathFactory) -> str:
    rows = make_rows(ROWS, "s0", "w0", text_chars=TEXT_CHARS)
    url = str(tmp_path_factory.mktemp("wide") / "job")
    return write_outputs(url, {"s0": rows}, make_manifest({"s0": rows}, 60.0), row_group_rows=2_000)


@pytest.fixture
def tracked_pool():
    """Route pyarrow's default allocations through a proxy that records the peak."""
    previous = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(previous)
    _KEEP_ALIVE.append(pool)
    pa.set_memory_pool(pool)
    try:
        yield pool
    finally:
        pa.set_memory_pool(previous)


def test_batches_are_bounded_and_projected(wide_job: str) -> None:
    batches = list(iter_metric_batches(open_outputs(wide_job), batch_rows=500))
    assert len(batches) == ROWS // 500
    assert max(b.num_rows for b in batches) == 500
    assert not hasattr(batches[0], "generated_text")
    assert "generated_text" not in METRIC_COLUMNS and "id" not in METRIC_COLUMNS


def test_report_never_decodes_the_text(wide_job: str, tracked_pool: pa.MemoryPool) -> None:
    report = load_report(wide_job)
    assert report["rows"]["total"] == ROWS
    peak_report = tracked_pool.max_memory()
    whole = pq.read_table(Path(wide_job) / "parts" / "part-s0.parquet")  # what reading it whole costs
    peak_whole = tracked_pool.max_memory()
    del whole
    print(f"arrow peak: report {peak_report / 1e6:.1f} MB, whole read {peak_whole / 1e6:.1f} MB")
    assert peak_whole > ROWS * TEXT_CHARS  # the check is sensitive: the text alone is 40 MB
    assert peak_report < 8_000_000
