"""The AMX GEMM for bf16 linears at decode row counts (models/amx_linear.py, models/csrc/amx_gemm.c): against
the exact product within bf16's error bound over row tails, bias, strided inputs and thread counts; rows
independent of the rest of the call; the layer's choice by row count; the choice by forced capability, setting
and model size; and an engine on a tiny model whose greedy tokens equal the oneDNN-only engine's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jobrunner.kernels import CAPABILITY_ENV, detect_cpu_capability
from jobrunner.models import amx_linear as amx
from jobrunner.models.onednn_linear import OneDnnLinear, onednn_bf16_supported, reorder_bf16_linears
from tests.components import cpu_lacks, require_library


def _amx_reason() -> str | None:
    """Why this machine cannot run the kernel: its CPU (not a forced capability) has no AMX, or torch has no oneDNN
    bf16 here. Where it can, a kernel that does not build fails (the ``amx_kernel`` fixture)."""
    capability, _ = detect_cpu_capability()
    lacking = cpu_lacks("amx")
    if lacking or capability != "amx" or not onednn_bf16_supported():
        return lacking or f"needs a CPU with AMX and oneDNN bf16 (capability {capability})"
    return None


AMX_REASON = _amx_reason()  # this machine's, before any test forces a capability


@pytest.fixture
def amx_kernel() -> None:
    if AMX_REASON is not None:
        pytest.skip(AMX_REASON)
    require_library(amx._library())


needs_amx = pytest.mark.usefixtures("amx_kernel")


def _bound(x, w, b, exact):
    # float32 sums of bf16 products, one rounding to bf16: |error| <= 2^-8 |y| + (K + 2) eps32 |x|.|w|
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    return 2.0**-8 * exact.abs() + (x.shape[1] + 2) * torch.finfo(torch.float32).eps * scale + 1e-30


@needs_amx
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 33, 64, 72, 128, 300])
@pytest.mark.parametrize("k,n,bias", [(576, 960, False), (1536, 576, True), (32, 16, True), (64, 48, False)])
def test_matches_the_exact_product_within_bf16_rounding(rows, k, n, bias):
    torch.manual_seed(rows * 7 + n)
    x, w = torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    packed = amx.amx_pack(w)
    got = amx.amx_linear(x, packed, b)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    assert ((got.double() - exact).abs() <= _bound(x, w, b, exact)).all()


@needs_amx
def test_strided_rows_threads_and_batch_invariance():
    torch.manual_seed(5)
    w, b = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
    packed = amx.amx_pack(w)
    wide = torch.randn(45, 100).bfloat16()
    x = wide[:, :64]                                   # row stride 100, unit column stride
    got = amx.amx_linear(x, packed, b)
    assert torch.equal(got, amx.amx_linear(x.contiguous(), packed, b))
    alone = torch.cat([amx.amx_linear(x[i:i + 1], packed, b) for i in range(45)])
    assert torch.equal(got, alone)                     # a row's bits do not depend on the rest of the call
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(got, amx.amx_linear(x, packed, b))
    finally:
        torch.set_num_threads(threads)


@needs_amx
def test_the_layer_takes_the_amx_gemm_up_to_its_row_limit(monkeypatch):
    torch.manual_seed(2)
    layer = torch.nn.Linear(64, 32, bias=True).bfloat16()
    one = OneDnnLinear(layer, amx=True)
    assert one.amx_packed is not None and "AMX GEMM" in one.extra_repr()
    calls = []
    real = amx.amx_linear
    monkeypatch.setattr("jobrunner.models.onednn_linear.amx_linear",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with torch.no_grad():
        for rows in (1, amx.AMX_GEMM_MAX_ROWS, amx.AMX_GEMM_MAX_ROWS + 1):
            x = torch.randn(rows, 64).bfloat16()
            exact = F.linear(x.double(), layer.weight.double(), layer.bias.double())
            assert ((one(x).double() - exact).abs() <= _bound(x, layer.weight, layer.bias, exact)).all()
    assert calls == [1, amx.AMX_GEMM_MAX_ROWS]        # above the limit: oneDNN
    odd = OneDnnLinear(torch.nn.Linear(40, 37).bfloat16(), amx=True)
    assert odd.amx_packed is None                      # 37 % 16, 40 % 32: oneDNN only


@pytest.mark.parametrize("capability,setting,size,expected,text", [
    ("avx512_bf16", "", 1 << 20, False, "needs AMX"),
    ("avx2", "1", 1 << 20, True, None),                # asked for: on, if this machine can run it
    ("amx", "0", 1 << 20, False, "JOBRUNNER_AMX_GEMM=0"),
    ("amx", "", 3 << 30, False, "above the 2 GiB kept twice"),
    ("amx", "1", 3 << 30, True, None),
    ("amx", "", 1 << 20, True, None)])
def test_the_choice_follows_capability_setting_and_size(monkeypatch, capability, setting, size, expected, text):
    monkeypatch.setenv(CAPABILITY_ENV, capability)
    monkeypatch.setenv(amx.AMX_GEMM_ENV, setting)
    use, why = amx.amx_gemm_choice(size)
    if expected and AMX_REASON is not None:         # wanted, but this machine cannot run the kernel
        assert not use
        return
    assert use is expected, why
    if text:
        assert text in why


@needs_amx
def test_reorder_reports_the_amx_gemm_and_packs_both(monkeypatch):
    monkeypatch.delenv(amx.AMX_GEMM_ENV, raising=False)
    model = torch.nn.ModuleDict({"proj": torch.nn.Linear(64, 32).bfloat16()})
    num, why = reorder_bf16_linears(model)
    assert num == 1 and why.endswith(f"amx: AMX GEMM up to {amx.AMX_GEMM_MAX_ROWS} rows")
    assert model["proj"].amx_packed is not None and model["proj"].packed is not None
    monkeypatch.setenv(amx.AMX_GEMM_ENV, "0")
    model = torch.nn.ModuleDict({"proj": torch.nn.Linear(64, 32).bfloat16()})
    num, why = reorder_bf16_linears(model)
    assert why.endswith(f"{amx.AMX_GEMM_ENV}=0") and model["proj"].amx_packed is None


@needs_amx
def test_an_engine_gives_the_onednn_engines_greedy_tokens(monkeypatch, tiny_llama_hf_dir):
    from jobrunner.engine import EngineConfig, LLMEngine, SamplingParams

    def generate(setting):
        monkeypatch.setenv(amx.AMX_GEMM_ENV, setting)
        engine = LLMEngine.from_source(str(tiny_llama_hf_dir), dtype="bfloat16",
                                       config=EngineConfig(max_num_seqs=4, speculative="off", device="cpu"))
        outs = engine.generate([[1, 5, 9, 33, 7], [4, 4, 2]], SamplingParams(max_tokens=12, temperature=0.0,
                                                                              ignore_eos=True))
        return engine, [t for o in outs for t in o.output_token_ids]

    engine, tokens = generate("")
    assert "AMX GEMM up to" in engine.model_info["cpu_gemm"]
    assert any(getattr(m, "amx_packed", None) is not None for m in engine.model.modules())
    plain, plain_tokens = generate("0")
    assert all(getattr(m, "amx_packed", None) is None for m in plain.model.modules())
    assert tokens == plain_tokens
