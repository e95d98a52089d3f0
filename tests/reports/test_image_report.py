"""Images in a report (reports/images.py): images per row, input tokens split into text and image tokens, and
the input cost split the same way (worker-hour and token prices), with exact values."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from report_outputs import make_manifest, write_outputs

from jobrunner.reports import load_report
from jobrunner.reports.text import render_json, render_text


def _rows(shard_id: str, spec: list[tuple]) -> dict[str, list]:
    """spec: (prompt, output, error) per row; fixed latencies."""
    n = len(spec)
    return {"id": [f"{shard_id}:{i}" for i in range(n)], "generated_text": [None if r[2] else "t" for r in spec],
            "finish_reason": ["error" if r[2] else "stop" for r in spec], "error": [r[2] for r in spec],
            "num_prompt_tokens": [r[0] for r in spec], "num_cached_tokens": [0] * n,
            "num_output_tokens": [r[1] for r in spec], "ttft_s": [0.1] * n, "itl_mean_s": [0.01] * n,
            "e2e_s": [0.5] * n, "queue_s": [0.0] * n, "shard_id": [shard_id] * n, "worker_id": ["w0"] * n,
            "finish_time_s": [1.0] * n, "topic": ["t"] * n}


def _job(tmp_path: Path, images: dict[str, tuple[list, list]], spec_cost: dict | None = None) -> str:
    shards = {"a": _rows("a", [(100, 10, None), (200, 20, None)]),
              "b": _rows("b", [(300, 30, None), (50, 0, "row b:1: image 1 of 1 (x.png, ...): not found")])}
    url = write_outputs(str(tmp_path / "j"), shards, make_manifest(shards, wall_s=10.0, worker_hour_usd=36.0,
                                                                    spec_cost=spec_cost))
    for part, (num_images, tokens) in images.items():
        path = Path(url) / "parts" / f"part-{part}.parquet"
        table = pq.read_table(path).append_column("num_images", pa.array(num_images, pa.int64()))
        pq.write_table(table.append_column("num_image_tokens", pa.array(tokens, pa.int64())), path)
    return url


def test_images_per_row_and_the_input_split(tmp_path: Path) -> None:
    url = _job(tmp_path, {"a": ([1, 2], [64, 128]), "b": ([0, 1], [0, 0])})
    report = load_report(url)
    # b:1 is an error row: its image counts per row, but the model never read it
    assert report["images"] == {"total": 4, "rows_with_images": 3, "per_row": 1.0, "per_image_row": 4 / 3,
                                "max_per_row": 2, "tokens": 192, "read": 3, "tokens_per_image": 64.0,
                                "rows_unreported": 0}
    assert (report["tokens"]["input"], report["tokens"]["image_input"], report["tokens"]["text_input"]) == \
        (650, 192, 458)
    cost = report["cost"]  # one worker, 10 s at $36 / h = $0.10; prefill 3 s of 9 s engine time: $1/30 input
    assert cost["input_usd"] == pytest.approx(0.1 / 3)
    assert cost["image_input_usd"] == pytest.approx(0.1 / 3 * 192 / 650)
    assert cost["text_input_usd"] == pytest.approx(0.1 / 3 * 458 / 650)
    assert cost["usd_per_image"] == pytest.approx(0.1 / 3 * 192 / 650 / 3)
    text = render_text([report])
    for line in ("images per row", "of the input: image tokens", "of the input cost: images", "$ / image"):
        assert line in text
    assert '"image_input": 192' in render_json([report])
    assert report["warnings"] == []


def test_token_prices_split_too_and_unreported_image_tokens_warn(tmp_path: Path) -> None:
    url = _job(tmp_path, {"a": ([1, 1], [64, None]), "b": ([0, 0], [0, 0])},
               spec_cost={"usd_per_m_input": 2.0, "usd_per_m_output": 8.0})
    report = load_report(url)
    assert report["images"]["rows_unreported"] == 1 and report["tokens"]["image_input"] == 64
    priced = report["cost"]["token_priced"]
    assert priced["image_input_usd"] == pytest.approx(64 * 2.0 / 1e6)
    assert priced["usd_per_image"] == pytest.approx(64 * 2.0 / 1e6 / 1)  # the row without a count: not read
    assert report["warnings"] == ["1 rows with images have no image-token count (the engine does not report "
                                  "one): their image tokens are counted as text input"]
    assert "token prices: $ / image" in render_text([report])


def test_a_job_without_image_columns_reports_as_before(tmp_path: Path) -> None:
    report = load_report(_job(tmp_path, {}))
    assert report["images"] is None
    assert "image_input" not in report["tokens"] and "usd_per_image" not in report["cost"]
    assert "images per row" not in render_text([report])
