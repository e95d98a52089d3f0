"""`jobrunner bench` defaults: no baseline unless asked, progress lines while it runs, the dtype calibration tool."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from jobrunner.cli import main
from jobrunner.quant.dispatch import CAPABILITY_ENV


def test_bench_runs_without_a_baseline_by_default_and_shows_progress(tiny_llama_hf_dir: Path,
                                                                     tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"prompt number {i}"}) + "\n" for i in range(4)))
    args = ["bench", "--prompts", str(path), "--model", str(tiny_llama_hf_dir), "--num-prompts", "4",
            "--max-tokens", "3", "--ignore-eos", "--device", "cpu", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["baseline"] is None and data["workload"]["baseline"] == "none"
    assert data["ours"]["num_output_tokens"] == 12
    log = result.stderr
    assert f"ours: loading model {tiny_llama_hf_dir} (prefix caching on)" in log
    assert "warming up, then 4 prompts x up to 3 tokens" in log
    assert "ours: 4/4 prompts done, 12 output tokens" in log and "(finished)" in log
    assert "hf:" not in log


def test_calibrate_dtype_reports_the_timing_and_the_capability_choice(monkeypatch) -> None:
    monkeypatch.setenv(CAPABILITY_ENV, "amx")
    result = CliRunner().invoke(main, ["bench", "--calibrate-dtype", "--json"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("GEMM 64x512x1024, best of 20: float32 ")
    assert lines[1].startswith("dtype auto -> bfloat16 (amx: bf16 GEMM hardware, forced")
    data = json.loads(lines[-1])
    assert data["auto"] == "bfloat16" and data["forced"] is True
    assert data["agrees"] == (data["measured_choice"] == "bfloat16")


def test_bench_needs_prompts_unless_calibrating() -> None:
    result = CliRunner().invoke(main, ["bench"])
    assert result.exit_code == 2 and ("--prompts is required (unless --calibrate-dtype, --quant-kernels, "
                                        "--gemm-paths, --kv-attention or --lora-steps)") in result.output
