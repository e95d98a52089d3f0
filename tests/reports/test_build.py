"""Every figure of a report on a small hand-made output, with exact expected values."""

from __future__ import annotations

from pathlib import Path

import pytest
from report_outputs import make_manifest, write_outputs

from jobrunner.reports import Slo, load_report


def _rows(shard_id: str, worker_id: str, spec: list[tuple]) -> dict[str, list]:
    """spec: (prompt, cached, output, ttft, itl, e2e, queue, finish_time, error) per row."""
    cols = ("num_prompt_tokens", "num_cached_tokens", "num_output_tokens", "ttft_s", "itl_mean_s", "e2e_s",
            "queue_s", "finish_time_s", "error")
    rows = {name: [row[i] for row in spec] for i, name in enumerate(cols)}
    n = len(spec)
    rows.update(id=[f"{shard_id}:{i}" for i in range(n)], shard_id=[shard_id] * n, worker_id=[worker_id] * n,
                generated_text=[None if e else "text" for e in rows["error"]],
                finish_reason=["error" if e else "stop" for e in rows["error"]], topic=["t"] * n)
    return rows


@pytest.fixture
def small_job(tmp_path: Path) -> str:
    shards = {
        "a": _rows("a", "w0", [(100, 50, 10, 0.1, 0.01, 0.2, 0.05, 1.0, None),
                               (100, 0, 20, 0.3, 0.02, 0.7, 0.10, 2.0, None)]),
        "b": _rows("b", "w1", [(200, 100, 30, 0.2, 0.03, 1.1, 0.00, 3.0, None),
                               (5000, 0, 0, None, None, None, None, 0.5, "prompt too long: 5000 > 2048")]),
    }
    manifest = make_manifest(shards, wall_s=10.0, quantization="int8", job_name="small",
                             worker_hour_usd=36.0)
    return write_outputs(str(tmp_path / "small"), shards, manifest)


def test_counts_tokens_and_errors(small_job: str) -> None:
    report = load_report(small_job)
    assert report["rows"] == {"total": 4, "ok": 3, "errors": 1, "error_rate": 0.25,
                              "errors_by_kind": {"prompt too long": 1},
                              "finish_reasons": {"error": 1, "stop": 3}, "stopped_at_max_tokens": 0,
                              "stopped_at_max_tokens_rate": 0.0, "json_checked": None, "json_invalid": None,
                              "json_valid_rate": None}
    assert report["tokens"] == {"input": 5400, "cached": 150, "output": 60, "total": 5460,
                                "prefix_cache_hit_rate": pytest.approx(150 / 5400), "ideal_cached": None,
                                "ideal_prefix_cache_hit_rate": None, "prefix_cache_of_ideal": None,
                                "ideal_covers_input_tokens": None, "reasoning": None, "answer": None}
    assert report["run"]["model"]["quantization"] == "int8"
    assert report["run"]["label"] == "small" and report["run"]["complete"] is True
    assert report["warnings"] == []


def test_prefix_cache_hits_against_the_ideal(tmp_path: Path) -> None:
    from jobrunner.reports.text import render_text

    shards = {"a": _rows("a", "w0", [(100, 50, 10, 0.1, 0.01, 0.2, 0.05, 1.0, None),
                                     (100, 0, 20, 0.3, 0.02, 0.7, 0.10, 2.0, None)])}
    manifest = make_manifest(shards, wall_s=1.0)
    manifest["prefix_cache"] = {"block_size": 16, "ideal_cached_tokens": 80, "chains": {}, "complete": True}
    report = load_report(write_outputs(str(tmp_path / "j"), shards, manifest))
    assert report["tokens"]["ideal_cached"] == 80
    assert report["tokens"]["ideal_prefix_cache_hit_rate"] == pytest.approx(80 / 200)
    assert report["tokens"]["prefix_cache_of_ideal"] == pytest.approx(50 / 80)
    text = render_text([report])
    assert "ideal prefix-cache hit rate" in text and "62.5%" in text


def test_time_throughput_and_cost(small_job: str) -> None:
    report = load_report(small_job)
    # make_manifest: 2 workers alive 10 s each, prefill 3 s + decode 6 s each.
    assert report["time"]["wall_s"] == 10.0 and report["time"]["worker_seconds"] == 20.0
    assert report["time"]["num_workers"] == 2
    assert report["throughput"]["tokens_per_s"] == pytest.approx(546.0)
    assert report["throughput"]["output_tokens_per_s"] == pytest.approx(6.0)
    assert report["throughput"]["rows_per_worker_s"] == pytest.approx(0.2)
    cost = report["cost"]
    assert cost["price_source"] == "manifest"
    assert cost["total_usd"] == pytest.approx(0.2)  # 20 s x $36/h
    assert cost["prefill_share"] == pytest.approx(1 / 3)
    assert cost["usd_per_m_total"] == pytest.approx(0.2 / 5460 * 1e6)
    assert cost["usd_per_m_input"] == pytest.approx(0.2 / 3 / 5400 * 1e6)
    assert cost["usd_per_m_output"] == pytest.approx(0.2 * 2 / 3 / 60 * 1e6)


def test_latency_percentiles(small_job: str) -> None:
    latency = load_report(small_job)["latency_s"]
    assert latency["ttft_s"]["count"] == 3
    assert latency["ttft_s"]["p50"] == pytest.approx(0.2)
    assert latency["ttft_s"]["p90"] == pytest.approx(0.28)
    assert latency["e2e_s"]["max"] == pytest.approx(1.1)
    assert latency["queue_s"]["p50"] == pytest.approx(0.05)


def test_command_line_price_wins(small_job: str) -> None:
    report = load_report(small_job, worker_hour_usd=72.0)
    assert report["cost"]["price_source"] == "command line"
    assert report["cost"]["total_usd"] == pytest.approx(0.4)


def test_goodput_from_the_command_line(small_job: str) -> None:
    goodput = load_report(small_job, slo=Slo(ttft_s=0.25, e2e_s=1.0))["goodput"]
    # Only row a:0 meets both (a:1 has ttft 0.3, b:0 has e2e 1.1, b:1 failed).
    assert goodput["rows_met"] == 1 and goodput["row_share"] == 0.25
    assert goodput["output_tokens_met"] == 10
    assert goodput["output_token_share"] == pytest.approx(10 / 60)
    assert goodput["cost"]["usd_per_m_total"] == pytest.approx(0.2 / 110 * 1e6)


def test_goodput_and_price_from_the_spec(tmp_path: Path) -> None:
    shards = {"a": _rows("a", "w0", [(10, 0, 5, 0.1, 0.01, 0.2, 0.0, 1.0, None),
                                     (10, 0, 5, 0.5, 0.01, 0.6, 0.0, 1.0, None)])}
    manifest = make_manifest(shards, 2.0, spec_cost={"worker_hour_usd": 1.8, "slo_ttft_s": 0.2},
                             worker_hour_usd=0.0)
    report = load_report(write_outputs(str(tmp_path / "j"), shards, manifest))
    assert report["cost"]["price_source"] == "job spec"
    assert report["cost"]["total_usd"] == pytest.approx(0.001)
    assert report["goodput"]["slo_ttft_s"] == 0.2 and report["goodput"]["row_share"] == 0.5


def test_no_goodput_without_targets(small_job: str) -> None:
    assert load_report(small_job)["goodput"] is None


def test_timeline_holds_every_token(small_job: str) -> None:
    charts = load_report(small_job)["charts"]
    output = charts["output_tokens_per_s"]
    assert sum(output["tokens_per_s"]) * output["bin_s"] == pytest.approx(60)
    assert output["t"][-1] <= 10.0 + output["bin_s"]
    input_ = charts["input_tokens_per_s"]
    assert sum(input_["tokens_per_s"]) * input_["bin_s"] == pytest.approx(5400)


def test_errors_by_kind_lists_the_top_20(tmp_path: Path) -> None:
    failed = (10, 0, 0, None, None, None, None, 1.0)
    spec = [(*failed, f"{chr(65 + i % 25)} failed: detail {i}") for i in range(50)]
    spec.append((*failed, "A failed: once more"))
    shards = {"a": _rows("a", "w0", spec)}
    report = load_report(write_outputs(str(tmp_path / "j"), shards, make_manifest(shards, 1.0)))
    kinds = report["rows"]["errors_by_kind"]
    assert list(kinds)[0] == "A failed" and kinds["A failed"] == 3
    assert len(kinds) == 21 and kinds["(other kinds)"] == 10 and sum(kinds.values()) == 51


def _points(svg: str) -> list[tuple[float, float]]:
    import re

    (points,) = re.findall(r'<polyline class="series"[^>]* points="([^"]+)"', svg)
    return [tuple(map(float, p.split(","))) for p in points.split()]


def test_chart_values_are_the_data(small_job: str) -> None:
    """The CDF and bar charts draw the report's numbers: positions and labels, not just element counts."""
    import re

    from jobrunner.reports.charts import cost_chart, latency_cdf_chart
    from jobrunner.reports.svg import HEIGHT, MARGIN_BOTTOM, MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, WIDTH

    report = load_report(small_job)
    cdf = report["charts"]["latency_cdf"]["ttft_s"]  # ttft 0.1, 0.3, 0.2 (the error row has none)
    assert (cdf["x"][0], cdf["x"][100], cdf["x"][-1]) == pytest.approx((0.1, 0.2, 0.3))
    assert (cdf["p"][0], cdf["p"][100], cdf["p"][-1]) == (0.0, 0.5, 1.0)
    points = _points(latency_cdf_chart([report], "ttft_s"))
    assert len(points) == len(cdf["x"])
    left, right, top, bottom = MARGIN_LEFT, WIDTH - MARGIN_RIGHT, MARGIN_TOP, HEIGHT - MARGIN_BOTTOM
    for (_px, py), p in zip(points, cdf["p"], strict=True):  # y: 0% at the bottom, 100% at the top, linear
        assert py == pytest.approx(bottom - p * (bottom - top), abs=0.01)
    (x0, _), (x_mid, _) = points[0], points[100]  # x: linear in seconds from the axis origin
    assert (x0 - left) / (x_mid - left) == pytest.approx(0.1 / 0.2, abs=1e-3)
    assert max(px for px, _ in points) <= right

    cheap = load_report(small_job, worker_hour_usd=36.0)
    dear = {**cheap, "run": {**cheap["run"], "label": "dear"},
            "cost": {k: v * 3 if isinstance(v, float) else v for k, v in cheap["cost"].items()}}
    svg = cost_chart([cheap, dear])
    bars = re.findall(r'<rect class="bar" x="[^"]+" y="[^"]+" width="([^"]+)"[^>]*><title>([^<]+)</title>', svg)
    widths = {title.rsplit(" ", 1)[0]: float(width) for width, title in bars}
    # Bar lengths keep the ratio of the values (drawn to 0.01 px; bars under 1 px are drawn 1 px long).
    assert widths["dear: output"] == pytest.approx(3 * widths["small: output"], rel=1e-3)
    assert widths["dear: blended"] == pytest.approx(3 * widths["small: blended"], rel=1e-2)
    assert cheap["cost"]["usd_per_m_total"] == pytest.approx(0.2 / 5460 * 1e6)  # $0.2 over 5460 tokens
    titles = [title for _, title in bars]
    assert "small: blended $36.63" in titles and "dear: blended $109.89" in titles
    blended_to_output = cheap["cost"]["usd_per_m_total"] / cheap["cost"]["usd_per_m_output"]
    assert widths["small: blended"] / widths["small: output"] == pytest.approx(blended_to_output, rel=1e-2)


def test_reasoning_tokens_split_the_output_and_its_cost(small_job: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for part, reasoning in (("a", [6, 15]), ("b", [20, None])):  # an error row has none
        path = Path(small_job) / "parts" / f"part-{part}.parquet"
        table = pq.read_table(path)
        pq.write_table(table.append_column("num_reasoning_tokens", pa.array(reasoning, pa.int64())), path)
    report = load_report(small_job)
    assert (report["tokens"]["reasoning"], report["tokens"]["answer"]) == (41, 60 - 41)
    output_usd = report["cost"]["output_usd"]
    assert report["cost"]["reasoning_usd"] == pytest.approx(output_usd * 41 / 60)
    assert report["cost"]["usd_per_m_answer"] == pytest.approx(output_usd / 19 * 1e6)
    from jobrunner.reports.text import render_text

    text = render_text([report])
    assert "of the output: reasoning tokens" in text and "$ / M answer tokens (their reasoning paid)" in text


def test_a_tensor_parallel_run_shows_its_split_in_json_text_and_html(tmp_path: Path) -> None:
    from jobrunner.reports.html import render_html
    from jobrunner.reports.text import render_json, render_text

    shards = {"a": _rows("a", "w0", [(100, 0, 10, 0.1, 0.01, 0.2, 0.05, 1.0, None)])}
    manifest = make_manifest(shards, wall_s=10.0, job_name="tp")
    manifest["model"].update(tensor_parallel_size=2, tensor_parallel_rank=0, rank_weights_bytes=2_500_000,
                             rank_kv_bytes=4_194_304)
    manifest["workers"]["w0"]["ranks"] = [{"rank": r, "node": "node-1", "pid": 10 + r, "device": "cpu",
                                           "cores": [r], "weights_bytes": 2_500_000} for r in (0, 1)]
    report = load_report(write_outputs(str(tmp_path / "tp"), shards, manifest))
    split = report["run"]["tensor_parallel"]
    assert (split["tensor_parallel_size"], split["rank_weights_bytes"], split["rank_kv_bytes"]) == (2, 2_500_000,
                                                                                                  4_194_304)
    summary = "tensor parallel 2: per rank weights 2.5 MB, KV cache 4.2 MB; w0: 2 ranks x cpu, cores [0] [1]"
    assert split["summary"] == summary and '"rank_kv_bytes": 4194304' in render_json([report])
    text = render_text([report])
    assert "  tensor parallel size" in text and "2,500,000" in text and "4,194,304" in text
    assert "  tensor-parallel ranks" in text and "w0: 2 ranks x cpu, cores [0] [1]\n" in text
    html = render_html([report])
    assert "tensor parallel 2," in html and "KV cache per rank (bytes)" in html
    one_rank = load_report(write_outputs(str(tmp_path / "one"), shards, make_manifest(shards, wall_s=10.0)))
    assert one_rank["run"]["tensor_parallel"] is None and "tensor parallel" not in render_text([one_rank])
