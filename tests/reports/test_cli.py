"""`jobrunner report` through click's CliRunner: formats, several runs side by side, errors, --out."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from report_outputs import make_rows

from jobrunner.cli import main


@pytest.fixture
def runs(job_factory: Callable[..., str]) -> list[str]:
    """none / int8 / int4 runs of the same job, the quantized ones faster."""
    return [job_factory("none", quantization="none", error_every=50),
            job_factory("int8", quantization="int8", speed=1.5),
            job_factory("int4", quantization="int4", speed=2.0)]


def _invoke(*args: str) -> object:
    return CliRunner().invoke(main, ["report", *args], catch_exceptions=False)


def test_text_report(runs: list[str]) -> None:
    result = _invoke(runs[0], "--worker-hour-usd", "2.5")
    assert result.exit_code == 0, result.output
    for needle in ("TTFT p99", "prefix-cache hit rate", "$ / M output tokens", "$2.50",
                   "error prompt too long: 20 rows"):
        assert needle in result.output


def test_side_by_side_with_ratios_and_quantization(runs: list[str]) -> None:
    result = _invoke(*runs, "--format", "md", "--slo-ttft-s", "0.1")
    assert result.exit_code == 0, result.output
    header = result.output.splitlines()[2]
    assert header == "| figure | example [none] | example [int8] | example [int4] |"
    quant = next(line for line in result.output.splitlines() if "run: quantization" in line)
    assert quant == "| run: quantization | none | int8 | int4 |"
    rows = next(line for line in result.output.splitlines() if line.startswith("| rows: rows "))
    assert rows.count("(1.00x)") == 2
    assert "goodput: rows meeting SLO" in result.output


def test_json_for_several_runs(runs: list[str]) -> None:
    result = _invoke(*runs[:2], "--format", "json")
    document = json.loads(result.output)
    assert document["baseline"] == "example [none]"
    assert [r["run"]["model"]["quantization"] for r in document["runs"]] == ["none", "int8"]
    tokens_per_s = [r["throughput"]["tokens_per_s"] for r in document["runs"]]
    assert tokens_per_s == [pytest.approx(_tokens_per_s(1.0, 50), rel=1e-12),
                            pytest.approx(_tokens_per_s(1.5), rel=1e-12)]


def _tokens_per_s(speed: float, error_every: int = 0) -> float:
    """What the fixture's job yields: every row's prompt and output tokens over the wall time write_job records
    (the last finish + 1 s); 10,876.35 and 15,809.92 tokens / s here."""
    rows = [make_rows(500, f"s{i:03d}", f"w{i}", seed=i, speed=speed, error_every=error_every) for i in range(2)]
    tokens = sum(sum(r["num_prompt_tokens"]) + sum(r["num_output_tokens"]) for r in rows)
    return tokens / (max(max(r["finish_time_s"]) for r in rows) + 1.0)


def test_out_file_and_format_from_extension(runs: list[str], tmp_path: Path) -> None:
    out = tmp_path / "sub" / "cmp.html"
    result = _invoke(*runs, "--out", str(out))
    assert result.exit_code == 0
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.count('<svg class="chart"') == 7
    json_out = tmp_path / "r.json"
    _invoke(runs[0], "--out", str(json_out))
    assert json.loads(json_out.read_text())["rows"]["total"] == 1000


def test_clear_errors(tmp_path: Path, runs: list[str]) -> None:
    result = CliRunner().invoke(main, ["report", str(tmp_path / "nope")])
    assert result.exit_code == 1
    assert "no jobrunner outputs here" in result.output
    result = CliRunner().invoke(main, ["report", runs[0], "--worker-hour-usd", "nan"])
    assert result.exit_code == 2 and "finite number" in result.output
    result = CliRunner().invoke(main, ["report", runs[0], "--storage-options", "[1]"])
    assert result.exit_code == 2 and "JSON object" in result.output
    result = CliRunner().invoke(main, ["report"])
    assert result.exit_code == 2
