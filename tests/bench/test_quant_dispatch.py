"""The dispatch benchmark's in-process measurement (tiny model) and its table with the targets."""

from __future__ import annotations

import pytest

from jobrunner.bench.quant_dispatch import measure_here, render
from jobrunner.quant.dispatch import CAPABILITY_ENV


def test_measure_here_on_a_tiny_model_with_avx2_forced(tiny_llama_hf_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CAPABILITY_ENV, "avx2")
    result = measure_here(str(tiny_llama_hf_dir), ["none", "int8", "int4"], [1, 2], max_tokens=2,
                          prompts=["hello there", "the quick brown fox"], rounds=1)
    assert set(result["tok_s"]) == {"none", "int8", "int4"}
    assert all(set(row) == {"1", "2"} and min(row.values()) > 0 for row in result["tok_s"].values())
    assert result["profile"]["capability"] == "avx2" and result["dispatch"]["none"] is None
    assert result["dispatch"]["int4"]["dequant_dtype"] == "float32"
    assert result["dtype"] == {"none": "float32", "int8": "float32", "int4": "float32"}


def test_render_marks_the_targets() -> None:
    dispatch = {"max_kernel_tokens": {"int8": 4, "int4": 16}, "dequant_dtype": "float32", "fp8_native": False}
    result = {"profile": {"capability": "avx2", "forced": True, "fast_bf16": False, "calibration": None},
              "threads": 2, "dtype": {"none": "float32", "int8": "float32", "int4": "float32"},
              "dispatch": {"none": None, "int8": dispatch, "int4": dispatch},
              "tok_s": {"none": {"1": 20.0, "64": 100.0}, "int8": {"1": 30.0, "64": 90.0},
                        "int4": {"1": 19.0, "64": 80.0}}}
    table = render("avx2", result)
    assert "| int8 | 30.0 | 90.0 | 1.50x | 0.90x | b1 ok, b64 ok |" in table
    assert "| int4 | 19.0 | 80.0 | 0.95x | 0.80x | b1 MISSED, b64 MISSED |" in table
    assert "* int4 (model float32): weight-only kernel up to 16 tokens, then dequantized tiles in float32" in table


def test_bench_cli_runs_the_dispatch_check_per_capability_in_a_fresh_process(tiny_llama_hf_dir, tmp_path) -> None:
    import json

    from click.testing import CliRunner

    from jobrunner.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n{"prompt": "the quick brown fox"}\n')
    args = ["bench", "--model", str(tiny_llama_hf_dir), "--prompts", str(prompts), "--max-tokens", "2",
            "--raw-prompts", "--batch-sizes", "1,2", "--quant-dispatch", "avx2", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "## avx2: capability avx2 (forced True)" in result.output
    measured = json.loads(result.output.strip().splitlines()[-1])["quant_dispatch"]["avx2"]
    assert set(measured["tok_s"]) == {"none", "int8", "int4"} and measured["profile"]["forced"] is True
    refused = CliRunner().invoke(main, [*args[:-3], "--quant-dispatch", "avx512"])
    assert refused.exit_code == 2 and "native and/or avx2" in refused.output


def test_bench_cli_times_one_layer_per_path() -> None:
    from click.testing import CliRunner

    from jobrunner.cli import main

    result = CliRunner().invoke(main, ["bench", "--quant-kernels", "--batch-sizes", "1"])
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert lines[0].startswith("torch ") and "microseconds, best of 7" in lines[0]
    assert [line.split()[0] for line in lines[1:]] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"]
    assert all("tokens=  1 float=" in line and "int4_layer=" in line for line in lines[1:])
