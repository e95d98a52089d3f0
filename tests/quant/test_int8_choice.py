"""``model.quantization: int8`` runs the int8 scheme that is fastest on the machine (jobrunner.quant.choice):
w8a8 on avx512_bf16 / amx with bf16 activations, weight-only elsewhere; ``int8_weight_only`` pins weight-only."""

from __future__ import annotations

import pytest
import torch

from jobrunner.models.factory import load_for_engine
from jobrunner.quant.choice import INT8_WEIGHT_ONLY, resolve_int8
from jobrunner.quant.dispatch import CAPABILITY_ENV, CPU_CAPABILITIES

CPU = torch.device("cpu")


@pytest.mark.parametrize("capability", CPU_CAPABILITIES)
def test_int8_is_w8a8_where_that_is_faster_and_weight_only_elsewhere(capability: str) -> None:
    scheme, why = resolve_int8("int8", CPU, torch.bfloat16, capability)
    if capability in ("avx512_bf16", "amx"):
        assert scheme == "w8a8" and why.startswith(f"int8 on {capability}: w8a8") and INT8_WEIGHT_ONLY in why
    else:
        assert (scheme, why) == ("int8", None)
    # float32 activations (the dtype on CPUs without bf16 hardware, or asked for): weight-only
    assert resolve_int8("int8", CPU, torch.float32, capability) == ("int8", None)
    # pinned, and every other scheme, unchanged
    assert resolve_int8(INT8_WEIGHT_ONLY, CPU, torch.bfloat16, capability)[0] == "int8"
    for other in ("none", "int4", "fp8", "w8a8"):
        assert resolve_int8(other, CPU, torch.bfloat16, capability) == (other, None)


def test_the_manifest_says_what_int8_ran_and_why(tiny_llama_hf_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CAPABILITY_ENV, "amx")
    _, _, _, info = load_for_engine(str(tiny_llama_hf_dir), device="cpu", dtype="bfloat16", quantization="int8")
    assert info["quantization"] == "w8a8" and info["quantization_requested"] == "int8"
    assert info["quantization_choice"].startswith("int8 on amx: w8a8")
    assert info["quantization_report"]["layers"] == {"w8a8": 9}
    _, _, _, info = load_for_engine(str(tiny_llama_hf_dir), device="cpu", dtype="bfloat16",
                                    quantization=INT8_WEIGHT_ONLY)
    assert info["quantization"] == "int8" and info["quantization_requested"] == INT8_WEIGHT_ONLY
    assert info["quantization_report"]["layers"] == {"int8": 9}
    monkeypatch.setenv(CAPABILITY_ENV, "avx2")
    _, _, _, info = load_for_engine(str(tiny_llama_hf_dir), device="cpu", quantization="int8")
    assert info["quantization"] == "int8" and "quantization_choice" not in info


def test_the_spec_takes_int8_weight_only() -> None:
    from jobrunner.spec import JobSpec

    spec = JobSpec.model_validate({"name": "q", "input": {"url": "memory://in.parquet", "prompt_column": "prompt"},
                                   "output": {"url": "memory://out"},
                                   "model": {"quantization": INT8_WEIGHT_ONLY}})
    assert spec.model.quantization == INT8_WEIGHT_ONLY
