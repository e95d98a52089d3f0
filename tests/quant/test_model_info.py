"""What a quantized engine reports about the machine's choices (merged into the job manifest)."""

from __future__ import annotations

import pytest

from jobrunner.models.factory import load_for_engine
from jobrunner.quant.dispatch import CAPABILITY_ENV


def test_model_info_records_dtype_and_dispatch(tiny_llama_hf_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CAPABILITY_ENV, "avx2")
    _, _, _, info = load_for_engine(str(tiny_llama_hf_dir), device="cpu", quantization="int4")
    assert info["dtype"] == "float32"
    assert info["dtype_reason"] == ("auto -> float32: avx2: no bf16 GEMM hardware (AMX / avx512_bf16) "
                                     "(forced by JOBRUNNER_CPU_CAPABILITY)")
    assert info["quant_kernels"] == ("cpu avx2: int8 kernel <= 256 tokens, int4 kernel <= 256 tokens, "
                                     "else dequantized float32 tiles")
    assert info["quant_dispatch"]["dequant_dtype"] == "float32"
    # the tiny model's 2 x 4 linears are int4; its head int8 by int4's policy, said in the manifest's line
    assert info["quant_layers"].startswith("int4 8, int8 1 (lm_head: int4 keeps the head in int8); ")
    assert info["quant_layers"].endswith("x of bf16")
    monkeypatch.setenv(CAPABILITY_ENV, "amx")
    _, _, _, info = load_for_engine(str(tiny_llama_hf_dir), device="cpu", dtype="auto")
    assert info["dtype"] == "bfloat16" and info["dtype_choice"]["fast_bf16"] is True
    assert "quant_kernels" not in info
    assert info["dtype_reason"] == "auto -> bfloat16: amx: bf16 GEMM hardware (forced by JOBRUNNER_CPU_CAPABILITY)"


def test_manifest_model_section_keeps_the_choices(tiny_llama_hf_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    from jobrunner.driver.engine_factory import build_engine, describe_model
    from jobrunner.spec import JobSpec

    monkeypatch.setenv(CAPABILITY_ENV, "avx2")
    spec = JobSpec.model_validate({"name": "quant-info",
        "input": {"url": "memory://in.parquet", "prompt_column": "prompt"}, "output": {"url": "memory://out"},
        "model": {"source": str(tiny_llama_hf_dir), "quantization": "int8"},
        "engine": {"device": "cpu", "num_kv_blocks": 8}})
    model = describe_model(build_engine(spec), spec)
    assert model["dtype"] == "float32" and model["quantization"] == "int8"
    assert model["dtype_reason"] == ("auto -> float32: avx2: no bf16 GEMM hardware (AMX / avx512_bf16) "
                                     "(forced by JOBRUNNER_CPU_CAPABILITY)")
    assert model["quant_kernels"].startswith("cpu avx2: int8 kernel <= 256 tokens")
