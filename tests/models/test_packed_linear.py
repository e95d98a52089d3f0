"""The packed float32 GEMM (models/packed_linear.py) against F.linear, per forced capability: shapes with
tails (rows not a multiple of the tile, columns not a multiple of the panel), bias, strided inputs; batch
invariance (a row's bits do not depend on the other rows or the thread count); the choice by capability and
``JOBRUNNER_PACKED_GEMM``; and the swap in a real model loaded for the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from jobrunner.kernels import CAPABILITY_ENV, build_library
from jobrunner.models import packed_linear
from jobrunner.models.packed_linear import PACKED_ENV, PackedLinear, pack_linears, pack_weight, packed_gemm_choice
from tests.components import native_build_failed

CPUINFO = Path("/proc/cpuinfo").read_text(encoding="utf-8")
HAS_AVX2, HAS_AVX512 = " avx2" in CPUINFO, " avx512f" in CPUINFO


@pytest.fixture(params=["native", "avx512", "avx2", "default"])
def lib(request, monkeypatch):
    """The kernel built for this CPU, for forced AVX-512 / AVX2 and the portable x86-64 build (asked for with
    JOBRUNNER_PACKED_GEMM=1 where the capability would not choose it)."""
    if request.param != "native":
        if request.param == "avx512" and not HAS_AVX512:
            pytest.skip("this CPU has no AVX-512: the avx512 build is only compiled here")
        if request.param == "avx2" and not HAS_AVX2:
            pytest.skip("this CPU has no AVX2")
        monkeypatch.setenv(CAPABILITY_ENV, request.param)
    monkeypatch.setenv(PACKED_ENV, "1")
    use, why = packed_gemm_choice()
    if not use:  # forced on, with a build for every CPU here: only a failed build says no
        native_build_failed(why)
    return packed_linear.packed_library()


def _linear(n_in, n_out, bias, seed):
    torch.manual_seed(seed)
    layer = torch.nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        layer.weight.mul_(3)
    return layer


@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 12, 13, 95, 96, 97, 200])
@pytest.mark.parametrize("n_in,n_out,bias", [(576, 960, False), (40, 37, True), (1536, 576, False), (16, 1, True)])
def test_matches_f_linear(lib, rows, n_in, n_out, bias):
    layer = _linear(n_in, n_out, bias, rows + n_out)
    x = torch.randn(rows, n_in)
    with torch.no_grad():
        want = layer(x)
        exact = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
        got = PackedLinear(layer, lib)(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    # within the classic bound of a float32 dot product of n_in terms (elementwise: n_in * eps * |x| . |w|)
    bound = (n_in + 1) * torch.finfo(torch.float32).eps * (x.double().abs() @ layer.weight.double().abs().T)
    assert bool(((got.double() - exact).abs() <= bound + 1e-30).all())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_leading_dims_and_strided_rows(lib):
    layer = _linear(64, 48, True, 1)
    x = torch.randn(3, 5, 80)[..., 8:72]  # rows with a stride of 80, not contiguous
    with torch.no_grad():
        got = PackedLinear(layer, lib)(x)
        torch.testing.assert_close(got, layer(x), atol=1e-5, rtol=1e-5)
        assert got.shape == (3, 5, 48)


def test_a_rows_bits_do_not_depend_on_the_batch_or_the_threads(lib):
    layer = PackedLinear(_linear(576, 200, False, 2), lib)
    batch = torch.randn(130, 576)
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            alone = torch.cat([layer(batch[i:i + 1]) for i in range(len(batch))])
            for size in (7, 96, 130):
                for start in range(0, 130, size):
                    assert torch.equal(layer(batch[start:start + size]), alone[start:start + size])
            torch.set_num_threads(1 if threads > 1 else 2)
            assert torch.equal(layer(batch), alone)
    finally:
        torch.set_num_threads(threads)


def test_pack_weight_pads_the_last_panel_with_zeros():
    w = torch.arange(10 * 3, dtype=torch.float32).view(10, 3)
    packed = pack_weight(w, 4)
    assert packed.shape == (3, 3, 4)
    assert torch.equal(packed[0], w[:4].T) and torch.equal(packed[2, :, :2], w[8:].T)
    assert torch.equal(packed[2, :, 2:], torch.zeros(3, 2))


@pytest.mark.parametrize("capability,setting,expected", [
    ("avx2", "", True), ("avx2", "0", False), ("avx512_bf16", "", False), ("amx", "", False),
    ("default", "", False), ("avx512_vnni", "0", False)])
def test_the_choice_follows_the_capability_and_the_setting(monkeypatch, capability, setting, expected):
    monkeypatch.setenv(CAPABILITY_ENV, capability)
    monkeypatch.setenv(PACKED_ENV, setting)
    use, why = packed_gemm_choice()
    assert use is expected
    if setting == "0":
        assert why == "JOBRUNNER_PACKED_GEMM=0"
    elif not expected:
        assert why == f"{capability}: F.linear (the packed kernel is the default on avx2)"
    else:
        assert why == "avx2: packed float32 GEMM (16-column panels)"


def test_the_avx512_build_compiles(monkeypatch):
    monkeypatch.setenv(CAPABILITY_ENV, "avx512")
    try:
        path = build_library("packed_gemm", source=packed_linear.SOURCE)
    except OSError as exc:
        native_build_failed(f"no C compiler for the avx512 build ({exc})")
    assert path.stat().st_size > 0


def test_pack_linears_swaps_only_float32_linears_and_keeps_a_tied_embedding(lib):
    torch.manual_seed(3)
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(50, 32), "proj": torch.nn.Linear(32, 32),
                                 "bf16": torch.nn.Linear(32, 8).bfloat16(),
                                 "head": torch.nn.Linear(32, 50, bias=False)})
    model["head"].weight = model["embed"].weight
    table = model["embed"].weight.detach().clone()
    x = torch.randn(9, 32)
    with torch.no_grad():
        want = model["head"](model["proj"](x))
        num, why = pack_linears(model)
        assert num == 2 and why.endswith("-column panels)")
        assert isinstance(model["proj"], PackedLinear) and isinstance(model["head"], PackedLinear)
        assert type(model["bf16"]) is torch.nn.Linear
        assert torch.equal(model["embed"].weight, table)  # the embedding keeps its own table
        torch.testing.assert_close(model["head"](model["proj"](x)), want, atol=1e-5, rtol=1e-5)


def test_an_engine_on_a_real_model_runs_the_packed_layers(monkeypatch, tiny_llama_hf_dir):
    """Loaded for the engine with the packed GEMM asked for: every projection is packed, the manifest line
    says so, and greedy tokens equal the F.linear engine's."""
    from jobrunner.engine import EngineConfig, LLMEngine, SamplingParams

    def generate(setting):
        monkeypatch.setenv(PACKED_ENV, setting)
        engine = LLMEngine.from_source(str(tiny_llama_hf_dir), dtype="float32",
                                       config=EngineConfig(max_num_seqs=4, speculative="off", device="cpu"))
        outs = engine.generate([[1, 5, 9, 33, 7], [4, 4, 2]], SamplingParams(max_tokens=12, temperature=0.0,
                                                                              ignore_eos=True))
        return engine, [o.output_token_ids for o in outs]

    packed_engine, packed_tokens = generate("1")
    kinds = {type(m).__name__ for name, m in packed_engine.model.named_modules() if name.endswith("_proj")}
    if kinds != {"PackedLinear"}:
        native_build_failed(packed_engine.model_info["cpu_gemm"])
    assert packed_engine.model_info["cpu_gemm"].endswith("; 9 layers")  # 2 x (qkv, o, gate_up, down) + lm_head
    plain_engine, plain_tokens = generate("0")
    assert plain_engine.model_info["cpu_gemm"] == "JOBRUNNER_PACKED_GEMM=0"
    assert packed_tokens == plain_tokens


def test_each_old_weight_is_freed_as_its_layer_is_packed(lib, monkeypatch):
    """Packing a model never holds two copies of all its weights: when a layer is packed, the layers packed
    before it have let their row-major weights go."""
    import weakref

    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(3)))
    refs = [weakref.ref(layer.weight) for layer in model]
    alive_at_each_pack = []
    real_init = PackedLinear.__init__

    def spying_init(self, linear, library):
        alive_at_each_pack.append([r() is not None for r in refs])
        real_init(self, linear, library)

    monkeypatch.setattr(PackedLinear, "__init__", spying_init)
    assert pack_linears(model)[0] == 3
    assert alive_at_each_pack == [[True, True, True], [False, True, True], [False, False, True]]
    assert all(r() is None for r in refs)
