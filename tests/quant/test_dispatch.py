"""Per-machine dispatch of the quantized layers: decisions for forced AVX2 and fast-bf16 CPUs, both paths' numbers."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from jobrunner.models.factory import choose_dtype, describe_dtype_choice
from jobrunner.quant import Int4WeightOnlyLinear, Int8WeightOnlyLinear, quantize_model
from jobrunner.quant import dispatch as dispatch_module
from jobrunner.quant.dispatch import (
    CAPABILITY_ENV,
    calibrate_dtype,
    choose_cpu_dtype,
    cpu_profile,
    detect_cpu_capability,
    dispatch_for,
)
from jobrunner.quant.kernels import int8_int_mm, pack_int4_cuda_reference, unpack_int4_cuda
from jobrunner.quant.primitives import dequantize_int4
from tests.components import require_native


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def _linear(out_features: int, in_features: int) -> torch.nn.Linear:
    torch.manual_seed(3)
    return torch.nn.Linear(in_features, out_features, bias=True)


def test_avx2_and_fast_bf16_decisions() -> None:
    avx2 = dispatch_for("cpu", "avx2")
    assert (avx2.capability, avx2.compute_dtype) == ("avx2", torch.float32)
    for cap in ("avx512_bf16", "amx"):
        fast = dispatch_for("cpu", cap)
        assert (fast.capability, fast.compute_dtype) == (cap, torch.bfloat16)
        # bf16 tiles make dequantizing cheap: the packed kernel keeps fewer tokens than on AVX2
        assert all(fast.kernel_tokens(s) < avx2.kernel_tokens(s) for s in ("int8", "int4"))
    assert dispatch_for("cpu", "avx512").compute_dtype == torch.float32  # AVX512 without bf16 hardware
    assert dispatch_for("cpu", "avx2").to_dict()["dequant_dtype"] == "float32"


def test_dtype_auto_follows_the_capability() -> None:
    dtype, why = choose_cpu_dtype("avx2")
    assert dtype == torch.float32 and why["chosen"] == "float32" and why["forced"] is True
    assert why["reason"] == "avx2: no bf16 GEMM hardware (AMX / avx512_bf16)"
    dtype, why = choose_cpu_dtype("amx")
    assert dtype == torch.bfloat16 and why["reason"] == "amx: bf16 GEMM hardware"
    assert choose_dtype("float16", torch.device("cpu")) == (torch.float16, {"requested": "float16",
                                                                           "chosen": "float16"})


def test_capability_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CAPABILITY_ENV, "AVX2")
    assert detect_cpu_capability() == ("avx2", True)
    assert dispatch_for("cpu").compute_dtype == torch.float32
    chosen, why = choose_dtype("auto", torch.device("cpu"))
    assert chosen == torch.float32 and why["requested"] == "auto" and why["capability"] == "avx2"
    monkeypatch.setenv(CAPABILITY_ENV, "sse9")
    with pytest.raises(ValueError, match=f"{CAPABILITY_ENV}='sse9'"):
        dispatch_for("cpu")


@pytest.mark.parametrize(("capability", "expected"), [("default", "float32"), ("avx2", "float32"),
                                                      ("avx512", "float32"), ("avx512_vnni", "float32"),
                                                      ("avx512_bf16", "bfloat16"),
                                                      ("amx", "bfloat16")])
def test_dtype_auto_for_each_forced_capability(capability: str, expected: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CAPABILITY_ENV, capability)
    chosen, why = choose_dtype("auto", torch.device("cpu"))
    assert str(chosen) == f"torch.{expected}" and why["chosen"] == expected
    assert why["capability"] == capability and why["forced"] is True and why["calibration"] is None
    assert describe_dtype_choice(why).startswith(f"auto -> {expected}: {capability}: ")
    assert describe_dtype_choice(why).endswith("(forced by JOBRUNNER_CPU_CAPABILITY)")


def test_unforced_auto_never_times_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    """The choice is a function of the capability: no start-up GEMM timing that could flap between processes."""
    monkeypatch.delenv(CAPABILITY_ENV, raising=False)

    def no_timing(*args, **kwargs):
        raise AssertionError("dtype auto must not time a GEMM")

    monkeypatch.setattr(dispatch_module, "calibrate_gemm", no_timing)
    dispatch_module._cpu_profile.cache_clear()
    profile = cpu_profile()
    assert profile.forced is False and profile is cpu_profile()  # cached per process
    assert profile.calibration is None
    assert profile.fast_bf16 == (profile.capability in ("avx512_bf16", "amx"))
    chosen, why = choose_cpu_dtype()
    assert (chosen == torch.bfloat16) == profile.fast_bf16 and why["forced"] is False


def test_same_dtype_in_fresh_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CAPABILITY_ENV, raising=False)
    code = "from jobrunner.quant.dispatch import choose_cpu_dtype; print(choose_cpu_dtype()[1]['chosen'])"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop(CAPABILITY_ENV, None)
    seen = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=env).stdout.strip() for _ in range(3)}
    assert seen == {choose_cpu_dtype()[1]["chosen"]}


def test_calibration_is_an_explicit_tool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CAPABILITY_ENV, "avx2")
    result = calibrate_dtype(repeats=1)
    assert result["auto"] == "float32" and result["capability"] == "avx2" and result["forced"] is True
    assert result["calibration"]["float32_gflops"] > 0 and result["calibration"]["bfloat16_gflops"] > 0
    assert result["measured_choice"] in ("float32", "bfloat16")
    assert result["agrees"] == (result["measured_choice"] == "float32")


@pytest.mark.parametrize("cls", ["int8", "int4"])
def test_paths_by_token_count_and_compute_dtype(cls: str) -> None:
    lin = _linear(208, 128)  # 208 = 3 x 64 + 16: whole blocks and a partial one in the CPU int4 layout
    x = torch.randn(300, 128)  # above every crossover: the dequantized-tile path
    results = {}
    for cap, dtype, tol in (("avx2", torch.float32, 1e-6), ("avx512_bf16", torch.bfloat16, 1e-2)):
        d = dispatch_for("cpu", cap)
        # without int4's W4A8 batch path (on by default with VNNI; tests/quant/test_int4_int8.py): the float tiles
        d = dataclasses.replace(d, max_kernel_tokens={k: v for k, v in d.max_kernel_tokens.items() if k != "int4_int8"})
        q = Int8WeightOnlyLinear.from_linear(lin, d) if cls == "int8" else Int4WeightOnlyLinear.from_linear(lin, 32, d)
        limit = d.kernel_tokens(cls)
        assert q.path(limit) == "packed" and q.path(limit + 1) == "dequant"
        q.tile_rows = 64  # four tiles, the last one partial
        exact = torch.nn.functional.linear(x.double(), q.dequantized_weight().double(), lin.bias.double())
        with torch.no_grad():
            y = q(x)
        assert y.dtype == torch.float32 and _rel_err(y, exact) < tol
        assert list(q.scratch._buffers) == [("cpu", dtype)]  # the dequantized tiles are in the compute dtype
        results[cap] = y
    assert _rel_err(results["avx2"], results["avx512_bf16"]) < 1e-2


def test_int4_dequantized_tiles_match_the_packed_codes() -> None:
    q = Int4WeightOnlyLinear.from_linear(_linear(208, 256), 64, dispatch_for("cpu", "avx2"))
    codes = q.cpu_layout.unpack(q.weight_int4pack)
    ref = dequantize_int4(codes, q.scales_and_zeros.float(), 64, torch.float64)
    out = torch.empty(208, 256)
    for n0, n1 in ((0, 64), (64, 192), (192, 208)):  # tiles start on a block; the last is the partial block
        tile = q._fill(n0, n1, out[n0:n1])
        assert torch.allclose(tile.double(), ref[n0:n1], rtol=0, atol=1e-6)


def test_scratch_buffer_is_shared_and_reused(tiny_llama) -> None:
    report = quantize_model(tiny_llama, "int8", capability="avx2")
    assert report.dispatch["capability"] == "avx2" and report.summary()["dispatch"]["dequant_dtype"] == "float32"
    layers = [m for m in tiny_llama.modules() if isinstance(m, Int8WeightOnlyLinear)]
    assert len({id(m.scratch) for m in layers}) == 1 and report.scratch_bytes > 0
    scratch = layers[0].scratch._buffers[("cpu", torch.float32)]
    ids = torch.arange(280).reshape(2, 140) % 96  # 280 tokens: above the AVX2 crossover (dequantized tiles)
    with torch.no_grad():
        first = tiny_llama(ids)
        second = tiny_llama(ids)
    assert torch.equal(first, second)
    assert layers[0].scratch._buffers[("cpu", torch.float32)].data_ptr() == scratch.data_ptr()
    assert report.scratch_bytes == scratch.numel() * 4


def test_int8_w8a8_int_mm_close_to_float() -> None:
    lin = _linear(64, 96)
    q = Int8WeightOnlyLinear.from_linear(lin)
    x = torch.randn(5, 96)
    y = int8_int_mm(x, q.weight_int8, q.scales)  # 5 rows are padded to 24 for _int_mm
    exact = x @ q.dequantized_weight().t()
    assert y.shape == (5, 64) and _rel_err(y, exact) < 0.01


def _independent_int4_weight(q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """(code - 8) * scale + zero, group by group, written out here (not jobrunner's dequantize_int4); the scales
    and zeros rounded to bfloat16 as the layer stores them."""
    sz = scales_and_zeros.to(torch.bfloat16).double()
    w = torch.empty(q.shape, dtype=torch.float64)
    for g in range(q.shape[1] // group_size):
        cols = slice(g * group_size, (g + 1) * group_size)
        w[:, cols] = (q[:, cols].double() - 8) * sz[g, :, 0:1] + sz[g, :, 1:2]
    return w


def test_int4_both_cpu_paths_match_an_independent_dequantized_matmul() -> None:
    """The packed path is torch's own packer + kernel; the dequantized path reads torch's packing back with
    our unpacker. Both against a float64 matmul of weights dequantized here from the codes before packing."""
    from jobrunner.quant.primitives import quantize_int4_groupwise

    lin = _linear(208, 256)
    q, scales_and_zeros = quantize_int4_groupwise(lin.weight, 64)
    layer = Int4WeightOnlyLinear(q, scales_and_zeros, 64, lin.bias, dispatch_for("cpu", "avx2"))
    weight = _independent_int4_weight(q, scales_and_zeros, 64)
    torch.manual_seed(1)
    for num_tokens, path, tol in ((4, "packed", 1e-2), (300, "dequant", 1e-6)):  # the kernel rounds x to bf16
        x = torch.randn(num_tokens, 256)
        with torch.no_grad():
            y = layer(x)
        assert layer.path(num_tokens) == path
        assert _rel_err(y, x.double() @ weight.t() + lin.bias.double()) < tol, path


@pytest.mark.parametrize("row, col, lane, nibble", [
    (0, 0, 0, 0),     # row 0 -> lanes 0..3; byte 0 -> lane t % 4 == 0, first slot; even k -> nibbles 0..3
    (0, 1, 0, 4),     # odd k of the same byte: the low nibble, nibbles 4..7
    (3, 9, 12, 5),    # row 3 -> lanes 12..15; byte 4 -> offset t % 4 + 4 (slot 1) with t % 4 == 0; odd k
    (5, 29, 22, 7),   # byte 14 = 12 + t % 4 (slot 3) -> t % 4 == 2; odd k -> nibble 7 (the int32's sign bit)
])
def test_cuda_int4_packer_on_hand_packed_values(row: int, col: int, lane: int, nibble: int) -> None:
    """One code in an otherwise empty [8, 32] weight lands where tinygemm's m16n8k16 B layout puts it
    (aten/src/ATen/native/cuda/int4mm.cu: lane t holds row t // 4, bytes t%4, t%4+4, 8+t%4, 12+t%4 of its
    16-byte k-slice; high nibbles (even k) in nibbles 0..3, low nibbles (odd k) in 4..7). Worked out by hand
    here, not with the packer's own order table; the GPU test checks the packer against torch's real one."""
    q = torch.zeros(8, 32, dtype=torch.int64)
    q[row, col] = 9
    packed = pack_int4_cuda_reference(q, 2)
    expected = torch.zeros(1, 1, 32, 1, dtype=torch.int64)
    expected[0, 0, lane, 0] = 9 << (4 * nibble)
    expected = torch.where(expected >= 2**31, expected - 2**32, expected).to(torch.int32)
    assert torch.equal(packed, expected)


@pytest.mark.parametrize("inner_k_tiles", [2, 4, 8])
def test_cuda_int4_layout_read_back(inner_k_tiles: int) -> None:
    torch.manual_seed(0)
    q = torch.randint(0, 16, (24, 48 * inner_k_tiles))
    packed = pack_int4_cuda_reference(q, inner_k_tiles)
    assert packed.shape == (3, 3, 32, inner_k_tiles // 2) and packed.dtype == torch.int32
    assert torch.equal(unpack_int4_cuda(packed), q.to(torch.uint8))
    assert torch.equal(unpack_int4_cuda(packed, 1, 2), q[8:16].to(torch.uint8))


def test_crossovers_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOBRUNNER_QUANT_KERNEL_TOKENS", "int4=64")
    assert dispatch_for("cpu", "avx2").max_kernel_tokens == {"int8": 256, "int4": 64}
    monkeypatch.setenv("JOBRUNNER_QUANT_KERNEL_TOKENS", "int3=4")
    with pytest.raises(ValueError, match="JOBRUNNER_QUANT_KERNEL_TOKENS: bad item 'int3=4'"):
        dispatch_for("cpu", "avx2")


@pytest.mark.parametrize("split", [True, False])
def test_native_int4_unpack_matches_torch(split: bool) -> None:
    from jobrunner.quant.int4_native import int4_unpack_fn
    from jobrunner.quant.int4_unpack import CpuInt4Layout

    unpack = require_native("int4 unpack", int4_unpack_fn)
    torch.manual_seed(0)
    k, block_n, nb, ld = 64, 32, 3, 112  # out wider than the blocks: the last 16 columns stay untouched
    packed = torch.randint(0, 256, (nb, k, block_n // 2), dtype=torch.uint8)
    layout = CpuInt4Layout(nb * block_n, k, block_n, split)
    codes = layout.unpack(packed.reshape(-1)).double().t()  # [K, nb * block_n]
    scale, offset = torch.rand(k // 32, ld) + 0.5, torch.randn(k // 32, ld)
    out = torch.full((k, ld), -7.0)
    unpack(packed, scale, offset, out, block_n, split, 32)
    expect = codes * scale.double().repeat_interleave(32, 0)[:, :96] + offset.double().repeat_interleave(32, 0)[:, :96]
    assert torch.allclose(out[:, :96].double(), expect, rtol=0, atol=1e-5)
    assert torch.equal(out[:, 96:], torch.full((k, 16), -7.0))
    assert dispatch_for("cpu", "avx2").int4_unpack == "c"
    # the bfloat16 variant writes the float32 result rounded to nearest even (torch's own conversion)
    out_bf16 = torch.full((k, ld), -7.0, dtype=torch.bfloat16)
    int4_unpack_fn(torch.bfloat16)(packed, scale, offset, out_bf16, block_n, split, 32)
    assert torch.equal(out_bf16, out.to(torch.bfloat16))
    assert int4_unpack_fn(torch.float16) is None  # no such variant: the torch path


def test_large_int8_weights_leave_the_packed_kernel_sooner(monkeypatch: pytest.MonkeyPatch) -> None:
    avx2, fast = dispatch_for("cpu", "avx2"), dispatch_for("cpu", "avx512_bf16")
    head = 49152 * 576  # SmolLM2's lm_head: 28 M int8 weights, beyond the caches
    assert avx2.kernel_tokens_for("int8", head) == 16 and avx2.kernel_tokens_for("int8", 3072 * 576) == 256
    assert fast.kernel_tokens_for("int8", head) == fast.kernel_tokens("int8") == 8  # already below
    assert avx2.kernel_tokens_for("int4", head) == avx2.kernel_tokens("int4")  # int8 only
    monkeypatch.setattr(dispatch_module, "CPU_LARGE_INT8_WEIGHTS", 1000)
    layer = Int8WeightOnlyLinear.from_linear(_linear(64, 32), avx2)  # 2048 weights: "large" now
    assert layer.path(16) == "packed" and layer.path(17) == "dequant"
