"""W8A8 on CPU: int8 per-channel weights with per-token int8 activations (jobrunner.quant.w8a8)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))

from tiny import make_hf_model, make_tokenizer  # noqa: E402

from jobrunner.engine import EngineConfig  # noqa: E402
from jobrunner.engine.llm_engine import LLMEngine  # noqa: E402
from jobrunner.models.factory import describe_dispatch  # noqa: E402
from jobrunner.models.loader import build_model, load_weights  # noqa: E402
from jobrunner.quant import quantize_model  # noqa: E402
from jobrunner.quant.dispatch import CPU_CAPABILITIES, dispatch_for  # noqa: E402
from jobrunner.quant.i8_gemm import vnni_linear  # noqa: E402
from jobrunner.quant.int8 import Int8WeightOnlyLinear  # noqa: E402
from jobrunner.quant.primitives import (  # noqa: E402
    quantize_rows_asym,
    quantize_rows_int8,
    quantize_rows_u8,
    w8a8_reference,
    w8a8_reference_asym,
)
from jobrunner.quant.smooth import smooth_mlps  # noqa: E402
from jobrunner.quant.w8a8 import W8A8Linear  # noqa: E402
from jobrunner.quant.w8a8_native import w8a8_native  # noqa: E402
from tests.components import cpu_lacks, require_native  # noqa: E402

VNNI = torch.cpu._is_vnni_supported()
VNNI_KERNEL = cpu_lacks("avx512_bf16")  # why the AVX-512 VNNI kernel cannot run here (None: it runs)
KERNELS = ["int_mm", pytest.param("onednn", marks=pytest.mark.skipif(
    not VNNI, reason="oneDNN's u8 x s8 GEMM is exact only with VNNI / AMX-INT8 (dispatch never picks it elsewhere)")),
    pytest.param("vnni", marks=pytest.mark.skipif(VNNI_KERNEL is not None, reason=f"{VNNI_KERNEL}"))]


@pytest.mark.parametrize("kernel", [k for k in KERNELS if getattr(k, "values", (k,))[0] != "vnni"])
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_w8a8_layer_matches_float64_reference(kernel: str, tokens: int) -> None:
    """The layer computes the dequantized weight times the per-token quantized input, exactly up to float32
    rounding (an int32 accumulation, then two scalings): relative error < 1e-5 of the output's range."""
    gen = torch.Generator().manual_seed(tokens)
    linear = torch.nn.Linear(96, 48, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 96, generator=gen) * 0.1)
    layer = W8A8Linear.from_linear(linear, kernel)
    x = torch.randn(tokens, 96, generator=gen) * torch.rand(tokens, 1, generator=gen) * 4  # rows of any range
    x[0, :] = 0.0  # a zero row: scale 1, output = bias
    reference = w8a8_reference if kernel == "onednn" else w8a8_reference_asym  # our GEMM's rows: asymmetric
    expected = reference(x, layer.weight_int8, layer.scales) + linear.bias.double()
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (tokens, 48)
    assert ((y.double() - expected).abs().max() / expected.abs().max()).item() < 1e-5
    assert torch.allclose(y[0], linear.bias)
    # a row's result does not depend on its neighbours (per-token scales)
    assert torch.equal(layer(x[-1:]), y[-1:])
    # bf16 activations in, bf16 out (the engine's dtype on fast-bf16 CPUs; oneDNN writes bf16 itself, the row
    # scale is applied in float32): within two bf16 roundings of the reference of the same bf16 input
    xb = x.bfloat16()
    yb = layer(xb)
    expected_b = reference(xb, layer.weight_int8, layer.scales) + linear.bias.double()
    assert yb.dtype == torch.bfloat16
    assert ((yb.double() - expected_b).abs().max() / expected_b.abs().max()).item() < 2 ** -7
    # decode at batch 1 may take the int8 weight-only kernel: the same weights, float (bf16) activations
    layer.weight_only_tokens = 1
    single = x[-1:]
    weight_only = single.double() @ layer.dequantized_weight(torch.float64).t() + linear.bias.double()
    assert ((layer(single).double() - weight_only).abs().max() / weight_only.abs().max()).item() < 2e-2


@pytest.mark.skipif(VNNI_KERNEL is not None, reason=f"{VNNI_KERNEL}")
@pytest.mark.parametrize("shape", [(128, 48), (576, 960), (1536, 576)])
def test_the_vnni_kernel_gives_the_int_mm_paths_bits(shape: tuple[int, int]) -> None:
    """kernels/csrc/gemm/i8_gemm.c: for bf16 rows, with and without a bias, at 1 to 200 rows, the same bits as the
    reference path (quantize_rows_asym, torch._int_mm, the zero points' column sums, the two scalings, one rounding
    to bf16, the bias added in bf16); its symmetric entry (int4's W4A8: quantize_rows_int8) the same bits as
    oneDNN's W8A8 GEMM (the scalings in its order); a row's result does not depend on the other rows or the thread
    count; strided rows are read as such."""
    k, n = shape
    gen = torch.Generator().manual_seed(k)
    for bias in (False, True):
        linear = torch.nn.Linear(k, n, bias=bias).to(torch.bfloat16)
        vnni, reference, onednn = (W8A8Linear.from_linear(linear, kernel) for kernel in ("vnni", "int_mm", "onednn"))
        assert vnni.kernel == "vnni" and vnni.vnni_packed is not None and reference.vnni_packed is None
        for rows in (1, 5, 6, 7, 70, 200):
            x = (torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 8).to(torch.bfloat16)
            x[0, : k // 2] = 0.0
            if rows > 2:
                x[2] = 0.0  # a zero row: scale 1
            y = vnni(x)
            assert y.dtype == torch.bfloat16 and torch.equal(y, reference(x))
            symmetric = vnni_linear(x, vnni.vnni_packed, n, vnni.bias, "vnni", asymmetric=False)
            assert torch.equal(symmetric, onednn(x)) and not torch.equal(symmetric, y)
            assert torch.equal(vnni(x[-1:]), y[-1:])
        wide = torch.randn(9, 2 * k, generator=gen).to(torch.bfloat16)
        assert torch.equal(vnni(wide[:, :k]), reference(wide[:, :k].contiguous()))
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(vnni(x), y)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.skipif(VNNI_KERNEL is not None, reason=f"{VNNI_KERNEL}")
def test_the_vnni_kernel_takes_float32_rows_and_leaves_other_shapes_to_onednn() -> None:
    """float32 activations: rounded to bf16, then the kernel (within bf16 roundings of the float64 reference);
    a layer shape the kernel does not take (in % 64, out % 16) runs oneDNN's GEMM instead."""
    gen = torch.Generator().manual_seed(5)
    linear = torch.nn.Linear(128, 32, bias=True)
    layer = W8A8Linear.from_linear(linear, "vnni")
    x = torch.randn(4, 128, generator=gen)
    y = layer(x)
    expected = w8a8_reference_asym(x.bfloat16(), layer.weight_int8, layer.scales) + linear.bias.double()
    assert y.dtype == torch.float32
    assert ((y.double() - expected).abs().max() / expected.abs().max()).item() < 2 ** -7
    assert W8A8Linear.from_linear(torch.nn.Linear(96, 32), "vnni").kernel == "onednn"
    assert W8A8Linear.from_linear(torch.nn.Linear(128, 40), "vnni").kernel == "onednn"


def test_quantize_rows_asym_uses_the_whole_code_range_of_a_lopsided_row() -> None:
    """Asymmetric per-token codes: x ~ s (u - z) with lo = min(x, 0), hi = max(x, 0), s = (hi - lo) / 255; a row of
    one sign gets all 256 codes (twice the symmetric resolution), a zero row scale 1 and zero point 0, and a row's
    codes never depend on the other rows."""
    x = torch.tensor([[0.0, 1.0, 2.55, 0.5], [0.0, 0.0, 0.0, 0.0], [-1.0, 3.0, 0.0, 0.25], [-5.1, -2.0, 0.0, -0.1]])
    u, scale, zero = quantize_rows_asym(x)
    assert u.dtype == torch.uint8 and scale.dtype == torch.float32 and zero.dtype == torch.int32
    assert zero.flatten().tolist() == [0, 0, 64, 255] and scale[1].item() == 1.0 and (u[1] == 0).all()
    assert u[0].tolist() == [0, 100, 255, 50] and u[3, 0].item() == 0 and u[3, 2].item() == 255
    back = (u.float() - zero) * scale
    assert (back - x).abs().max().item() <= scale.max().item() / 2 + 1e-6
    torch.manual_seed(0)
    lopsided = torch.rand(64, 512) ** 4 * torch.where(torch.rand(64, 1) < 0.5, 1.0, -1.0)  # each row one sign
    q, sym_scale = quantize_rows_int8(lopsided)
    u, asym_scale, zero = quantize_rows_asym(lopsided)
    sym_err = (q.float() * sym_scale - lopsided).abs().mean()
    asym_err = ((u.float() - zero) * asym_scale - lopsided).abs().mean()
    assert asym_err < 0.55 * sym_err
    assert torch.equal(quantize_rows_asym(lopsided[5:6])[0], u[5:6])


def test_quantize_rows_is_symmetric_per_token() -> None:
    x = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [254.0, 127.0, -1.0]])
    q, scale = quantize_rows_int8(x)
    assert q.dtype == torch.int8 and q.tolist() == [[64, -127, 32], [0, 0, 0], [127, 64, 0]]
    assert torch.allclose(scale.squeeze(1), torch.tensor([1 / 127, 1.0, 2.0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_u8_is_quantize_rows_plus_128(dtype: torch.dtype) -> None:
    """The kernel's fused quantization gives exactly the reference codes (+128, as uint8) and scales."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 40, generator=gen) * torch.rand(9, 1, generator=gen) * 30).to(dtype)
    x[2] = 0.0
    x[4, 7] = -x[4].abs().max() * 3  # the row's extreme is negative: code -127 -> 1
    q, scale = quantize_rows_int8(x)
    u8, scale_u8 = quantize_rows_u8(x)
    assert u8.dtype == torch.uint8 and torch.equal(u8, (q.int() + 128).to(torch.uint8))
    assert torch.equal(scale_u8, scale) and u8[4, 7].item() == 1 and (u8[2] == 128).all()


@pytest.mark.parametrize("kernel", KERNELS)
def test_w8a8_weight_bytes_count_the_kernel_copy(kernel: str) -> None:
    """Honest bytes: the int8 weight (1-token kernel, report, tied embedding) plus the kernel's own copy."""
    layer = W8A8Linear.from_linear(torch.nn.Linear(64, 32, bias=False), kernel)
    extra = 8 * 32 if kernel == "vnni" else 0  # the VNNI packing keeps each column's offset and scale
    assert layer.kernel_bytes() == 64 * 32 + extra
    assert layer.weight_bytes() == 2 * 64 * 32 + extra + 32 * 4


@pytest.mark.parametrize("capability", CPU_CAPABILITIES)
def test_w8a8_dispatch_for_each_forced_capability(capability: str, tiny_llama) -> None:
    """With int8 dot-product hardware the AVX-512 VNNI kernel on avx512_bf16 (where this CPU runs it) and oneDNN's
    int8 GEMM on avx512_vnni / amx; elsewhere int8 weight-only, said why."""
    expected = "onednn" if capability in ("avx512_vnni", "avx512_bf16", "amx") else None
    if capability == "avx512_bf16" and VNNI_KERNEL is None:
        expected = "vnni"
    assert dispatch_for("cpu", capability).w8a8_kernel == expected
    report = quantize_model(tiny_llama, "w8a8", capability=capability)
    assert report.dispatch["w8a8_kernel"] == expected
    layers = [m for m in tiny_llama.modules() if isinstance(m, (W8A8Linear, Int8WeightOnlyLinear))]
    assert len(layers) == 9  # 4 per block x 2 + lm_head
    if expected:  # every layer, down_proj too (its input smoothing folded into gate_up_proj)
        quantized = [m for n, m in tiny_llama.named_modules() if n in {x.name for x in report.layers}]
        assert all(isinstance(m, W8A8Linear) for m in quantized)
        # the VNNI kernel takes every call (no weight-only rows); a shape it cannot take keeps oneDNN
        assert all((m.kernel, m.weight_only_tokens) == ((expected, 0) if expected == "vnni" and
                                                        m.in_features % 64 == 0 and m.out_features % 16 == 0
                                                        else ("onednn", 0 if expected == "vnni" else 1))
                   for m in quantized)
        assert report.scheme_counts() == {"w8a8": 9} and report.fallbacks == []
        assert any("down_proj input smoothing" in note for note in report.notes)
        assert describe_dispatch(report.dispatch).endswith(f"; w8a8 via {expected}")
    else:
        assert all(isinstance(m, Int8WeightOnlyLinear) for m in layers)
        assert report.scheme_counts() == {"int8": 9}
        assert all("needs VNNI or AMX" in f.fallback_reason and capability in f.fallback_reason
                   for f in report.fallbacks)
    # the tied embedding reads the head's int8 table (stored once)
    assert tiny_llama.embed_tokens.weight_int8 is tiny_llama.lm_head.weight_int8


@pytest.mark.skipif(not VNNI, reason="the oneDNN W8A8 kernel runs only with VNNI / AMX-INT8")
def test_engine_with_w8a8_close_to_float() -> None:
    """The tiny model through the engine: w8a8 prompt log-probabilities within 0.15 nats of the float model's
    (int8 weights and activations; a wrong scale or zero point moves them by whole nats)."""
    tokenizer = make_tokenizer()
    hf_model = make_hf_model("llama_tied")
    engines = {}
    for scheme in ("none", "w8a8"):
        model = build_model(hf_model.config, torch.float32, torch.device("cpu"))
        load_weights(model, hf_model.state_dict().items())
        report = quantize_model(model, scheme, capability="avx512_bf16" if scheme == "w8a8" else None)
        assert scheme == "none" or report.scheme_counts()["w8a8"] == len(report.layers)
        engines[scheme] = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=32, enable_prefix_caching=False),
                                    eos_token_ids=[tokenizer.eos_token_id])
    worst = 0.0
    for text in ("The quick brown fox", "Natalia sold clips to 48 of her friends"):
        ids = tokenizer(text)["input_ids"]
        float_lp, w8a8_lp = (torch.tensor(engines[s].prompt_logprobs(ids)) for s in ("none", "w8a8"))
        worst = max(worst, (float_lp - w8a8_lp).abs().max().item())
    assert 0.0 < worst < 0.15


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_loops_give_the_torch_numbers(dtype: torch.dtype) -> None:
    """The C row quantization and output scaling are bit-identical to the torch ops they replace."""
    native = require_native("W8A8 row loops", w8a8_native)
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(37, 200, generator=gen) * torch.rand(37, 1, generator=gen) * 50).to(dtype)
    x[0] = 0.0
    x[3, 11] = -x[3].abs().max() * 2
    assert native.takes(x) and not native.takes(x.t())
    u8, scale = native.quantize(x)
    u8_ref, scale_ref = quantize_rows_u8(x)
    assert torch.equal(u8, u8_ref) and torch.equal(scale, scale_ref)
    y = torch.randn(37, 48, generator=gen) * 1e3
    assert torch.equal(native.rowscale(y.clone(), scale, dtype), (y * scale).to(dtype))
    q, scale_s = native.quantize(x, signed=True)  # the int8 codes for torch._int_mm (int4's int8 path)
    q_ref, _ = quantize_rows_int8(x)
    assert q.dtype == torch.int8 and torch.equal(q, q_ref) and torch.equal(scale_s, scale_ref)
    acc = torch.randint(-2**20, 2**20, (37, 48), generator=gen, dtype=torch.int32)
    col = torch.rand(60, generator=gen) * 1e-2
    out = torch.zeros(37, 60, dtype=dtype)
    native.scale_int32(acc, scale, col[5:53].contiguous(), out[:, 5:53])  # a column slice of a wider output
    assert torch.equal(out[:, 5:53], acc.mul(col[5:53]).mul_(scale).to(dtype))
    assert not out[:, :5].any() and not out[:, 53:].any()


def test_smoothing_keeps_the_float_function_and_down_proj_unsmoothed_stays_weight_only(tiny_llama) -> None:
    """Folding the down_proj input smoothing into gate_up_proj changes no float output; a down_proj whose
    gate_up_proj is not W8A8 (here: kept float) is not smoothed and stays int8 weight-only, with the reason."""
    ids = torch.arange(12)
    before = tiny_llama(ids)
    smoothed = smooth_mlps(tiny_llama, {"layers.0"})
    assert smoothed == ["layers.0"] and tiny_llama.layers[0].down_proj.weight.dtype == torch.float32
    assert torch.allclose(tiny_llama(ids), before, rtol=1e-4, atol=1e-5)
    report = quantize_model(tiny_llama, "w8a8", skip=("layers.1.gate_up_proj",), capability="avx512_bf16")
    assert isinstance(tiny_llama.layers[0].down_proj, W8A8Linear)
    assert isinstance(tiny_llama.layers[1].down_proj, Int8WeightOnlyLinear)
    assert [f.name for f in report.fallbacks] == ["layers.1.down_proj"]
    assert "outlier channels" in report.fallbacks[0].fallback_reason


@pytest.mark.skipif(VNNI_KERNEL is not None, reason=f"{VNNI_KERNEL}")
@pytest.mark.parametrize("shape", [(64, 48), (576, 960), (128, 16)])
def test_the_amx_int8_tile_source_gives_the_vnni_kernels_bits(shape: tuple[int, int]) -> None:
    """i8_gemm.c built for AMX-INT8 tiles (-DJR_W8A8_TILES), its tile operations emulated on vpdpbusd
    (include/jr_tile_avx512.h; library i8_tile_emulated): the VNNI build's bits for 1-200 rows (partial 16- and
    32-row tiles, an odd number of column blocks), with and without a bias, strided rows, one and two threads.
    What the real AMX build adds is the tile instructions themselves (not run here: no AMX)."""
    from jobrunner.kernels import load
    from tests.components import require_library

    k, n = shape
    vnni, tiles = require_library(load("i8_gemm")), require_library(load("i8_tile_emulated"))
    gen = torch.Generator().manual_seed(n)
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, generator=gen) / 100
    packed = torch.empty(n * k + 8 * n, dtype=torch.uint8)
    assert vnni.jr_i8_pack(w.data_ptr(), scales.data_ptr(), packed.data_ptr(), n, k) == 0
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        for rows in (1, 5, 16, 17, 31, 32, 33, 70, 200):
            wide = (torch.randn(rows, k + 64, generator=gen) * 4).to(torch.bfloat16)
            x = wide[:, :k]  # rows of stride k + 64
            for b, t in ((None, 2), (bias, 1)):
                torch.set_num_threads(t)
                outs = []
                for lib in (vnni, tiles):
                    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
                    assert lib.jr_i8_linear(x.data_ptr(), x.stride(0), packed.data_ptr(),
                                            None if b is None else b.data_ptr(), out.data_ptr(), n, rows, n, k, t) == 0
                    outs.append(out)
                assert not outs[1].isnan().any() and torch.equal(outs[0], outs[1])
    finally:
        torch.set_num_threads(threads)


def test_the_amx_int8_kernel_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """On amx oneDNN's int8 GEMM stays the default; JOBRUNNER_W8A8_AMX=1 asks for our tile kernel, which runs
    where the OS grants the tile state (an AMX CPU) and is refused, said why, elsewhere."""
    from jobrunner.quant.i8_gemm import AMX_ENV, amx_choice

    monkeypatch.delenv(AMX_ENV, raising=False)
    assert dispatch_for("cpu", "amx").w8a8_kernel == "onednn"
    assert amx_choice("amx") == (False, f"amx: the AMX-INT8 W8A8 kernel is opt-in ({AMX_ENV}=1 on amx)")
    monkeypatch.setenv(AMX_ENV, "1")
    use, why = amx_choice("amx")
    assert dispatch_for("cpu", "amx").w8a8_kernel == ("amx" if use else "onednn")
    assert use or "AMX" in why
    assert amx_choice("avx512_bf16")[0] is False  # only on amx


@pytest.mark.skipif(VNNI_KERNEL is not None, reason=f"{VNNI_KERNEL}")
def test_layers_on_our_gemm_hold_only_the_packed_weight_but_a_tied_head(tiny_llama) -> None:
    """w8a8 on the VNNI kernel: every layer but the tied head drops its plain int8 weight (1 byte per weight,
    not 2); the codes read back from the tiles are the same, so are the outputs and the dequantized weight; the
    tied embedding still shares the head's table."""
    quantize_model(tiny_llama, "w8a8", capability="avx512_bf16")
    gen = torch.Generator().manual_seed(0)
    dropped = 0
    for name, layer in tiny_llama.named_modules():
        if not isinstance(layer, W8A8Linear):
            continue
        assert layer.kernel == "vnni" or layer.in_features % 64 or layer.out_features % 16
        if layer.kernel != "vnni":
            continue
        reference = W8A8Linear(layer.codes().clone(), layer.scales, layer.bias, "vnni")  # plain copy kept
        if name == "lm_head":
            assert layer.weight_int8 is not None and tiny_llama.embed_tokens.weight_int8 is layer.weight_int8
        else:
            assert layer.weight_int8 is None
            assert layer.weight_bytes() == reference.weight_bytes() - layer.in_features * layer.out_features
            dropped += 1
        assert torch.equal(layer.dequantized_weight(), reference.dequantized_weight())
        x = torch.randn(9, layer.in_features, generator=gen).to(torch.bfloat16)
        assert torch.equal(layer(x), reference(x))
    assert dropped >= 4  # the tiny model's q|k|v, o, gate|up, down of a layer at least
