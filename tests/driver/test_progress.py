"""The driver's progress display: plain periodic lines when not on a terminal."""

from __future__ import annotations

import io

from jobrunner.driver.progress import Progress


def test_plain_lines_in_logs():
    out = io.StringIO()
    progress = Progress(total_rows=100, done_rows=20, file=out, interval_s=0.0)
    progress.update(rows=60, output_tokens=400)
    progress.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("[jobrunner] rows 60/100 (60%) | ") and "out tok/s" in lines[0]
    assert "ETA" in lines[0] and "\r" not in out.getvalue()


def test_disabled_progress_prints_nothing():
    out = io.StringIO()
    progress = Progress(total_rows=10, file=out, enabled=False)
    progress.update(rows=10, output_tokens=5)
    progress.close()
    assert out.getvalue() == ""
