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
