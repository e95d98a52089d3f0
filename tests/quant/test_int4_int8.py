"""int4's int8-GEMM batch path (quant.int4_int8): dispatch per forced capability, the native int4 -> int8
expansion against its torch reference, and the layer's numbers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from jobrunner.models.factory import describe_dispatch
from jobrunner.quant.dispatch import CROSSOVER_ENV, NO_LIMIT, dispatch_for
from jobrunner.quant.int4 import Int4WeightOnlyLinear
from jobrunner.quant.int4_native import int4_to_int8_fn
from jobrunner.quant.primitives import expand_int8_reference
from tests.components import require_native


@pytest.fixture
def native_int8() -> None:
    """The C int4 -> int8 expansion this path needs (a failed build fails under CI=true, see tests/components)."""
    require_native("int4 -> int8 expansion", int4_to_int8_fn)


needs_native = pytest.mark.usefixtures("native_int8")


def _layer(out_features: int, in_features: int, group_size: int, capability: str = "avx512_bf16",
           int4_int8: int = 4096) -> Int4WeightOnlyLinear:
    torch.manual_seed(5)
    linear = torch.nn.Linear(in_features, out_features, bias=True)
    base = dispatch_for("cpu", capability)
    limits = {**base.max_kernel_tokens, "int4": 8, "int4_int8": int4_int8}
    return Int4WeightOnlyLinear.from_linear(linear, group_size, dataclasses.replace(base, max_kernel_tokens=limits))


def test_int8_path_is_chosen_per_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    avx2 = dispatch_for("cpu", "avx2")
    assert "int4_int8" not in avx2.max_kernel_tokens  # no int8 dot-product hardware
    assert "W4A8" not in describe_dispatch(avx2.to_dict())
    for cap in ("avx512_vnni", "avx512_bf16", "amx"):  # on: the packed kernel up to 16 tokens, W4A8 above
        dispatch = dispatch_for("cpu", cap)
        rows = 4 if dispatch.w8a8_kernel in ("vnni", "amx") else 16  # the one-call kernel on our GEMM: from 5
        assert dispatch.kernel_tokens("int4") == rows and dispatch.kernel_tokens("int4_int8") == NO_LIMIT
        assert f"int4 above {rows} tokens: int8 GEMM, int8 activations (W4A8);" in \
            describe_dispatch(dispatch.to_dict())
    monkeypatch.setenv(CROSSOVER_ENV, "int4_int8=0")  # off: int4 stays weight-only (float tiles at batch)
    off = Int4WeightOnlyLinear.from_linear(torch.nn.Linear(64, 96), 32, dispatch_for("cpu", "avx512_bf16"))
    assert off.int8 is None and off.path(65) == "dequant"
    with pytest.raises(ValueError, match="int4_int8"):
        dispatch_for("cpu", "avx2")


@needs_native
@pytest.mark.parametrize("cap", ["avx512_vnni", "avx512_bf16", "amx"])
def test_int8_path_takes_the_batches_above_the_packed_kernel(cap: str) -> None:
    dispatch = dispatch_for("cpu", cap)
    layer = Int4WeightOnlyLinear.from_linear(torch.nn.Linear(64, 96), 32, dispatch)
    rows = dispatch.kernel_tokens("int4")
    assert [layer.path(t) for t in (1, rows, rows + 1, 5000)] == ["packed", "packed", "int8", "int8"]


@needs_native
@pytest.mark.parametrize(("shape", "group_size"), [((96, 64), 32), ((128, 128), 64)])
def test_native_expansion_matches_reference(shape: tuple[int, int], group_size: int) -> None:
    layer = _layer(*shape, group_size)
    n, k = shape
    codes = layer.cpu_layout.unpack(layer.weight_int4pack)
    ref = expand_int8_reference(codes, layer.scales_and_zeros, group_size, layer.int8.row_scale)
    out = layer.int8.fill(0, n, torch.empty(k, n, dtype=torch.int8))  # 96 rows: a partial block too
    diff = (out.t().int() - ref.int()).abs()
    # the C loop may fuse the multiply-add (one rounding): an exact .5 tie can land one code apart
    assert diff.max().item() <= 1 and diff.float().mean().item() < 0.01
    assert ref.abs().max().item() == 127  # each row's largest weight takes the full int8 range


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_path_close_to_dequantized_weight(dtype: torch.dtype) -> None:
    layer = _layer(96, 64, 32)
    torch.manual_seed(6)
    x = torch.randn(20, 64).to(dtype)
    assert layer.path(20) == "int8"
    y = layer(x)
    ref = x.double() @ layer.dequantized_weight().double().t() + layer.bias.double()
    assert y.dtype == dtype and y.shape == (20, 96)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 0.03
    # per-token activation scales: a row's result does not depend on the rest of the batch
    other = torch.cat([x[:1], 10 * torch.randn(19, 64).to(dtype)])
    assert torch.equal(layer(other)[0], y[0])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_activation_loops_give_the_torch_numbers(dtype: torch.dtype) -> None:
    """The row quantization and output scaling in C (quant.w8a8_native) match the torch ops bit for bit."""
    layer = _layer(208, 128, 32)  # 208 rows: whole 64-row blocks and a partial one
    layer.int8.tile_rows = 64  # several tiles, each scaled into its column slice
    x = (torch.randn(33, 128) * 3).to(dtype)
    with torch.no_grad():
        fast = layer(x)
        native, layer.int8.native = layer.int8.native, None
        slow = layer(x)
    assert native is not None and torch.equal(fast, slow)


def test_the_one_call_w4a8_kernel_gives_the_tile_paths_bits(monkeypatch) -> None:
    """Where W8A8 runs on our GEMM (avx512_bf16): jr_i4_linear (expand, pack, W8A8 GEMM in one call) gives the
    per-tile torch._int_mm path's bits, with and without a bias, for rows above the tinygemm crossover; float32
    rows keep the tile path."""
    from tests.components import require_cpu

    require_cpu("avx512_bf16")
    monkeypatch.setenv("JOBRUNNER_CPU_CAPABILITY", "avx512_bf16")
    monkeypatch.delenv("JOBRUNNER_W8A8_VNNI", raising=False)
    gen = torch.Generator().manual_seed(4)
    for k, n, bias in ((576, 960, True), (1536, 576, False), (128, 64, True)):
        linear = torch.nn.Linear(k, n, bias=bias).to(torch.bfloat16)
        layer = Int4WeightOnlyLinear.from_linear(linear, 32, dispatch_for("cpu"))
        path = layer.int8
        assert path is not None and path.kernel == "vnni"
        for rows in (17, 48, 130):
            x = (torch.randn(rows, k, generator=gen) * 3).to(torch.bfloat16)
            fast = layer(x)
            path.kernel = None
            tiles = layer(x)
            path.kernel = "vnni"
            assert torch.equal(fast, tiles)
        x32 = torch.randn(20, k, generator=gen)
        assert layer(x32).dtype == torch.float32


def test_both_ways_of_the_one_call_kernel_give_the_same_bits(monkeypatch) -> None:
    """jr_i4_linear expands each thread's column blocks straight into the GEMM's layout (the VNNI build, split
    int4 layout); the tile build (i8_tile_emulated here: AMX's source with the tiles on vpdpbusd) expands the
    whole layer to W^T, packs it, then multiplies. The same bits, 1-130 rows, one and two threads, with and
    without a bias, column blocks per thread not a multiple of the kernel's group of four."""
    import ctypes

    from jobrunner.kernels import load
    from tests.components import require_cpu, require_library

    require_cpu("avx512_bf16")
    monkeypatch.setenv("JOBRUNNER_CPU_CAPABILITY", "avx512_bf16")
    monkeypatch.delenv("JOBRUNNER_W8A8_VNNI", raising=False)
    fused, whole = require_library(load("i8_gemm")), require_library(load("i8_tile_emulated"))
    gen = torch.Generator().manual_seed(9)
    threads = torch.get_num_threads()
    try:
        for k, n, bias in ((576, 960, True), (1536, 576, False), (128, 64, True), (192, 1344, False)):
            layer = Int4WeightOnlyLinear.from_linear(torch.nn.Linear(k, n, bias=bias).to(torch.bfloat16), 32,
                                                     dispatch_for("cpu"))
            assert layer.int8 is not None and layer.int8.kernel == "vnni" and layer.cpu_layout.is_split
            assert layer.int8.expands_per_block
            struct = layer.int8.bind()
            assert not struct.wt and not struct.tiles  # no scratch taken for the per-block expansion
            wt, tiles = torch.empty(k * n, dtype=torch.int8), torch.empty(k * n + 8 * n, dtype=torch.uint8)
            struct.wt, struct.tiles = wt.data_ptr(), tiles.data_ptr()  # the whole-layer way's scratch
            w = ctypes.byref(struct)
            b = torch.randn(n, generator=gen).to(torch.bfloat16)
            for rows in (1, 7, 17, 48, 130):
                x = (torch.randn(rows, k, generator=gen) * 3).to(torch.bfloat16)
                for t in (1, 2):
                    torch.set_num_threads(t)
                    outs = []
                    for lib in (fused, whole):
                        out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
                        assert lib.jr_i4_linear(x.data_ptr(), k, w, b.data_ptr() if bias else None, out.data_ptr(),
                                                n, rows, n, k, t) == 0
                        outs.append(out)
                    assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1])
    finally:
        torch.set_num_threads(threads)
