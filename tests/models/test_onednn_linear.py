"""bf16 linears on oneDNN-reordered weights (models/onednn_linear.py): against a float64 product within bf16's
error bound, bias, 3-D / strided / empty inputs, batch invariance; the choice by forced capability and
``JOBRUNNER_ONEDNN_LINEAR``; the swap of bf16 linears only (a tied embedding keeps its table); and an engine on a
real model in bf16 giving the F.linear engine's greedy tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jobrunner.kernels import CAPABILITY_ENV
from jobrunner.models.amx_linear import AMX_GEMM_ENV
from jobrunner.models.onednn_linear import (
    ONEDNN_ENV,
    OneDnnLinear,
    onednn_bf16_choice,
    onednn_bf16_supported,
    reorder_bf16_linears,
)

needs_bf16 = pytest.mark.skipif(not onednn_bf16_supported(),
                                reason="this CPU has no bf16 hardware for oneDNN (avx512_bf16 / AMX)")


def _linear(n_in, n_out, bias, seed):
    torch.manual_seed(seed)
    return torch.nn.Linear(n_in, n_out, bias=bias).bfloat16()


@needs_bf16
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 200, 1100])
@pytest.mark.parametrize("n_in,n_out,bias", [(576, 960, False), (40, 37, True), (1536, 576, True)])
def test_matches_the_exact_product_within_bf16_rounding(rows, n_in, n_out, bias):
    layer = _linear(n_in, n_out, bias, rows + n_out)
    x = torch.randn(rows, n_in).bfloat16()
    with torch.no_grad():
        got = OneDnnLinear(layer)(x)
        want = F.linear(x, layer.weight, layer.bias)
        exact = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    # float32 accumulation, then one rounding to bf16 (and the bias's): |error| <= 2^-8 |y| + n eps32 |x|.|w|
    scale = x.double().abs() @ layer.weight.double().abs().T
    bound = 2.0**-8 * exact.abs() + (n_in + 2) * torch.finfo(torch.float32).eps * scale + 1e-30
    assert ((got.double() - exact).abs() <= bound).all()
    assert ((got.double() - want.double()).abs() <= 2 * bound).all()  # F.linear within the same bound


@needs_bf16
def test_shapes_strides_float_inputs_and_batch_invariance():
    layer = _linear(96, 80, True, 1)
    one = OneDnnLinear(layer)
    with torch.no_grad():
        x = torch.randn(2, 3, 96).bfloat16()
        assert one(x).shape == (2, 3, 80)
        torch.testing.assert_close(one(x), one(x.reshape(6, 96)).view(2, 3, 80), atol=0, rtol=0)
        wide = torch.randn(5, 200).bfloat16()
        assert torch.equal(one(wide[:, :96]), one(wide[:, :96].contiguous()))
        assert one(wide[:, :96].float()).dtype == torch.bfloat16
        batch = torch.randn(64, 96).bfloat16()
        alone = torch.cat([one(batch[i:i + 1]) for i in range(64)])
        assert torch.equal(one(batch), alone)  # a row's bits do not depend on the rest of the call
    assert one.weight_bytes() == 96 * 80 * 2


@pytest.mark.parametrize("capability,setting,expected", [
    ("amx", "", True), ("avx512_bf16", "", False), ("avx2", "", False), ("amx", "0", False),
    ("avx512_bf16", "1", True)])
def test_the_choice_follows_the_capability_and_the_setting(monkeypatch, capability, setting, expected):
    monkeypatch.setenv(CAPABILITY_ENV, capability)
    monkeypatch.setenv(ONEDNN_ENV, setting)
    use, why = onednn_bf16_choice()
    if expected and not onednn_bf16_supported():  # asked for, but this torch / CPU has no oneDNN bf16
        assert not use and "no oneDNN bf16 kernels" in why
        return
    assert use is expected, why
    if expected:
        assert why == f"{capability}: bf16 GEMM on oneDNN-reordered weights"
    if setting == "0":
        assert why == f"{ONEDNN_ENV}=0"


@needs_bf16
def test_only_bf16_linears_are_swapped_and_a_tied_embedding_keeps_its_table(monkeypatch):
    monkeypatch.setenv(ONEDNN_ENV, "1")
    torch.manual_seed(3)
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(50, 32).bfloat16(),
                                 "proj": torch.nn.Linear(32, 32).bfloat16(), "f32": torch.nn.Linear(32, 8),
                                 "head": torch.nn.Linear(32, 50, bias=False).bfloat16()})
    model["head"].weight = model["embed"].weight
    table = model["embed"].weight.detach().clone()
    x = torch.randn(9, 32).bfloat16()
    with torch.no_grad():
        want = model["head"](model["proj"](x))
        num, why = reorder_bf16_linears(model)
        assert num == 2 and "bf16 GEMM on oneDNN-reordered weights" in why
        assert isinstance(model["proj"], OneDnnLinear) and isinstance(model["head"], OneDnnLinear)
        assert type(model["f32"]) is torch.nn.Linear
        assert torch.equal(model["embed"].weight, table)
        torch.testing.assert_close(model["head"](model["proj"](x)), want, atol=0.05, rtol=0.02)


@needs_bf16
def test_an_engine_in_bf16_runs_the_reordered_layers(monkeypatch, tiny_llama_hf_dir):
    """Loaded for the engine in bf16 with the oneDNN path asked for: every projection swapped, the manifest line
    says so, and the greedy tokens equal the F.linear engine's (bf16 F.linear runs oneDNN's kernels too)."""
    from jobrunner.engine import EngineConfig, LLMEngine, SamplingParams

    def generate(setting):
        monkeypatch.setenv(ONEDNN_ENV, setting)
        engine = LLMEngine.from_source(str(tiny_llama_hf_dir), dtype="bfloat16",
                                       config=EngineConfig(max_num_seqs=4, speculative="off", device="cpu"))
        outs = engine.generate([[1, 5, 9, 33, 7], [4, 4, 2]], SamplingParams(max_tokens=12, temperature=0.0,
                                                                              ignore_eos=True))
        return engine, [t for o in outs for t in o.output_token_ids]

    monkeypatch.setenv(AMX_GEMM_ENV, "0")  # oneDNN's layers alone (the packed GEMM: tests/models/test_amx_linear.py)
    engine, tokens = generate("1")
    kinds = {type(m).__name__ for name, m in engine.model.named_modules() if name.endswith("_proj")}
    assert kinds == {"OneDnnLinear"}
    assert "bf16 GEMM on oneDNN-reordered weights" in engine.model_info["cpu_gemm"]
    assert engine.model_info["cpu_gemm"].endswith("; 9 layers")
    plain, plain_tokens = generate("0")
    assert plain.model_info["cpu_gemm"] == f"{ONEDNN_ENV}=0"
    assert tokens == plain_tokens
