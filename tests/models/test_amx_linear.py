"""The packed bf16 GEMMs (models/amx_linear.py: kernels/csrc/gemm/amx_gemm.c with AMX, bf16_gemm.c with AVX-512
BF16), each under its forced capability where the CPU has it: against
the exact product within bf16's error bound over row tails, bias, strided inputs and thread counts; rows
independent of the rest of the call; the layer's choice by row count; the choice by forced capability, setting
and model size; and an engine on a tiny model whose greedy tokens equal the engine's without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jobrunner.kernels import CAPABILITY_ENV
from jobrunner.models import amx_linear as amx
from jobrunner.models.onednn_linear import OneDnnLinear, onednn_bf16_supported, reorder_bf16_linears
from tests.components import cpu_lacks, require_library

KERNEL_CPUS = ("amx", "avx512_bf16")  # the packed kernel of each: amx_gemm.c, bf16_gemm.c


def _reason(capability: str) -> str | None:
    """Why this machine cannot run ``capability``'s kernel: its CPU (not a forced capability) lacks it, or torch
    has no oneDNN bf16 here. Where it can, a kernel that does not build fails (the ``kernel_cpu`` fixture)."""
    lacking = cpu_lacks(capability)
    if lacking or not onednn_bf16_supported():
        return lacking or f"needs oneDNN bf16 ({capability})"
    return None


@pytest.fixture(params=KERNEL_CPUS)
def kernel_cpu(request, monkeypatch) -> str:
    """Each packed kernel under its capability (forced; an AMX CPU runs both)."""
    reason = _reason(request.param)
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setenv(CAPABILITY_ENV, request.param)
    require_library(amx._library())
    return request.param


needs_kernel = pytest.mark.usefixtures("kernel_cpu")


def _bound(x, w, b, exact):
    # float32 sums of bf16 products, one rounding to bf16: |error| <= 2^-8 |y| + (K + 2) eps32 |x|.|w|
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    return 2.0**-8 * exact.abs() + (x.shape[1] + 2) * torch.finfo(torch.float32).eps * scale + 1e-30


@needs_kernel
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


@needs_kernel
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


def test_the_layer_takes_the_packed_gemm_up_to_its_row_limit(monkeypatch, kernel_cpu):
    """AMX: up to AMX_GEMM_MAX_ROWS rows, oneDNN above (both weights kept); AVX-512 BF16: every call, the packed
    weight alone."""
    torch.manual_seed(2)
    layer = torch.nn.Linear(64, 32, bias=True).bfloat16()
    one = OneDnnLinear(layer, amx=True)
    assert one.amx_packed is not None and "packed bf16 GEMM" in one.extra_repr()
    assert (one.packed is None) is (kernel_cpu == "avx512_bf16")
    calls = []
    real = amx.amx_linear
    monkeypatch.setattr("jobrunner.models.onednn_linear.amx_linear",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a))
    rows_tried = (1, amx.AMX_GEMM_MAX_ROWS, amx.AMX_GEMM_MAX_ROWS + 1, 700)
    with torch.no_grad():
        for rows in rows_tried:
            x = torch.randn(rows, 64).bfloat16()
            exact = F.linear(x.double(), layer.weight.double(), layer.bias.double())
            assert ((one(x).double() - exact).abs() <= _bound(x, layer.weight, layer.bias, exact)).all()
    limit = amx.MAX_ROWS[kernel_cpu]
    assert calls == [r for r in rows_tried if limit is None or r <= limit]  # above the limit: oneDNN
    odd = OneDnnLinear(torch.nn.Linear(40, 37).bfloat16(), amx=True)
    assert odd.amx_packed is None and odd.packed is not None  # 37 % 16, 40 % 32: oneDNN only


@pytest.mark.parametrize("capability,setting,size,expected,text", [
    ("avx2", "", 1 << 20, False, "needs AMX or AVX-512 BF16"),
    ("avx2", "1", 1 << 20, False, "needs AMX or AVX-512 BF16"),  # asked for, but no kernel for that ISA
    ("avx512_bf16", "", 1 << 20, True, "AVX-512 BF16 GEMM at every row count"),
    ("avx512_bf16", "", 3 << 30, True, None),          # no second copy kept: no size limit
    ("avx512_bf16", "0", 1 << 20, False, "JOBRUNNER_AMX_GEMM=0"),
    ("amx", "0", 1 << 20, False, "JOBRUNNER_AMX_GEMM=0"),
    ("amx", "", 3 << 30, False, "above the 2 GiB kept twice"),
    ("amx", "1", 3 << 30, True, None),
    ("amx", "", 1 << 20, True, None)])
def test_the_choice_follows_capability_setting_and_size(monkeypatch, capability, setting, size, expected, text):
    monkeypatch.setenv(CAPABILITY_ENV, capability)
    monkeypatch.setenv(amx.AMX_GEMM_ENV, setting)
    use, why = amx.amx_gemm_choice(size)
    if expected and _reason(capability) is not None:  # wanted, but this machine cannot run the kernel
        assert not use
        return
    assert use is expected, why
    if text:
        assert text in why


def test_reorder_reports_the_packed_gemm_and_packs_both(monkeypatch, kernel_cpu):
    monkeypatch.delenv(amx.AMX_GEMM_ENV, raising=False)
    model = torch.nn.ModuleDict({"proj": torch.nn.Linear(64, 32).bfloat16()})
    num, why = reorder_bf16_linears(model)
    expected = {"amx": f"amx: AMX GEMM up to {amx.AMX_GEMM_MAX_ROWS} rows",
                "avx512_bf16": "avx512_bf16: AVX-512 BF16 GEMM at every row count"}[kernel_cpu]
    assert num == 1 and why.endswith(expected)
    assert model["proj"].amx_packed is not None and (model["proj"].packed is None) is (kernel_cpu != "amx")
    monkeypatch.setenv(amx.AMX_GEMM_ENV, "0")
    model = torch.nn.ModuleDict({"proj": torch.nn.Linear(64, 32).bfloat16()})
    num, why = reorder_bf16_linears(model)
    if kernel_cpu == "amx":  # oneDNN's layer, without the packed copy
        assert why.endswith(f"{amx.AMX_GEMM_ENV}=0") and model["proj"].amx_packed is None
    else:  # neither path chosen: the plain nn.Linear stays
        assert num == 0 and type(model["proj"]) is torch.nn.Linear


def test_an_engine_gives_the_plain_engines_greedy_tokens(monkeypatch, tiny_llama_hf_dir, kernel_cpu):
    from jobrunner.engine import EngineConfig, LLMEngine, SamplingParams

    def generate(setting):
        monkeypatch.setenv(amx.AMX_GEMM_ENV, setting)
        engine = LLMEngine.from_source(str(tiny_llama_hf_dir), dtype="bfloat16",
                                       config=EngineConfig(max_num_seqs=4, speculative="off", device="cpu"))
        outs = engine.generate([[1, 5, 9, 33, 7], [4, 4, 2]], SamplingParams(max_tokens=12, temperature=0.0,
                                                                              ignore_eos=True))
        return engine, [t for o in outs for t in o.output_token_ids]

    engine, tokens = generate("")
    assert "GEMM up to" in engine.model_info["cpu_gemm"] or "GEMM at every row count" in engine.model_info["cpu_gemm"]
    assert any(getattr(m, "amx_packed", None) is not None for m in engine.model.modules())
    plain, plain_tokens = generate("0")
    assert all(getattr(m, "amx_packed", None) is None for m in plain.model.modules())
    assert tokens == plain_tokens
