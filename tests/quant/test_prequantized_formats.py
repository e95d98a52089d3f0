"""Pre-quantized checkpoint formats: what quantization_config is read (or refused), and the repacking into our
layouts, checked against packers written here from the formats' definitions (tests/quant/fixtures/README.md)."""

from __future__ import annotations

import pytest
import torch

from jobrunner.quant.dispatch import dispatch_for
from jobrunner.quant.prequantized import ExactInt4Linear, read_checkpoint_quant, resolve_scheme
from jobrunner.quant.prequantized.repack import awq_unpack, gptq_codes, gptq_to_int4, gptq_zeros

FP8_GROUP = {
    "format": "float-quantized", "targets": ["Linear"], "output_activations": None,
    "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True},
}
FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
       "config_groups": {"group_0": FP8_GROUP}, "ignore": ["lm_head"], "kv_cache_scheme": None}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq", "pack_dtype": "int32", "lm_head": False}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


def _with(base: dict, **changes) -> dict:
    return {**base, **changes}


def _fp8_group(**changes) -> dict:
    return _with(FP8, config_groups={"group_0": _with(FP8_GROUP, **changes)})


def test_supported_configs_are_read() -> None:
    assert read_checkpoint_quant(None) is None
    fp8 = read_checkpoint_quant(FP8)
    assert (fp8.method, fp8.scheme, fp8.weight_scales, fp8.ignore) == ("fp8", "fp8", "channel", ("lm_head",))
    assert fp8.describe() == ("compressed-tensors fp8 e4m3, per-channel weight scales, dynamic per-token "
                              "activations")
    tensor = read_checkpoint_quant(_fp8_group(weights={**FP8_GROUP["weights"], "strategy": "tensor"}))
    assert tensor.weight_scales == "tensor"
    assert read_checkpoint_quant(GPTQ).describe() == "gptq 4-bit, group 128, symmetric (v1 zeros)"
    per_channel = read_checkpoint_quant(_with(GPTQ, group_size=-1, sym=False, checkpoint_format="gptq_v2"))
    assert per_channel.describe() == "gptq 4-bit, per channel, asymmetric (v2 zeros)"
    assert read_checkpoint_quant(AWQ).describe() == "awq 4-bit, group 128, asymmetric (GEMM layout)"
    assert read_checkpoint_quant(_with(AWQ, quant_method="AWQ")).scheme == "int4"
    symmetric = read_checkpoint_quant(_with(AWQ, zero_point=False))
    assert symmetric.describe() == "awq 4-bit, group 128, symmetric (GEMM layout)"


@pytest.mark.parametrize(("config", "named"), [
    (_with(GPTQ, bits=3), "gptq bits 3"),
    (_with(GPTQ, bits=8), "gptq bits 8"),
    (_with(GPTQ, desc_act=True), "gptq desc_act: true"),
    (_with(GPTQ, group_size=100), "gptq group_size 100"),
    (_with(GPTQ, checkpoint_format="marlin"), "gptq checkpoint_format 'marlin'"),
    (_with(GPTQ, lm_head=True), "gptq lm_head: true"),
    (_with(AWQ, version="gemv"), "awq version 'gemv'"),
    (_with(AWQ, bits=8), "awq bits 8"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "quant_method 'fp8'"),
    (_with(FP8, format="pack-quantized"), "compressed-tensors format 'pack-quantized'"),
    (_with(FP8, kv_cache_scheme={"num_bits": 8}), "compressed-tensors kv_cache_scheme"),
    (_fp8_group(input_activations={**FP8_GROUP["input_activations"], "dynamic": False, "strategy": "tensor"}),
     "input_activations 'tensor' dynamic=False"),
    (_fp8_group(input_activations=None), "without input_activations"),
    (_fp8_group(weights={**FP8_GROUP["weights"], "strategy": "block"}), "weights strategy 'block'"),
    (_fp8_group(weights={**FP8_GROUP["weights"], "type": "int", "num_bits": 4}), "weights 'int' 4-bit"),
])
def test_other_formats_are_refused_naming_the_option(config: dict, named: str) -> None:
    with pytest.raises(ValueError) as info:
        read_checkpoint_quant(config)
    message = str(info.value)
    assert named in message and "\n" not in message
    assert message.startswith("checkpoint quantization_config: ")


def test_spec_quantization_must_agree_with_the_checkpoint() -> None:
    gptq, fp8 = read_checkpoint_quant(GPTQ), read_checkpoint_quant(FP8)
    assert resolve_scheme("none", gptq) == "int4" and resolve_scheme("int4", gptq) == "int4"
    assert resolve_scheme("fp8", fp8) == "fp8" and resolve_scheme("int8", None) == "int8"
    with pytest.raises(ValueError, match=r"model.quantization 'int8' conflicts with the checkpoint's own "
                                         r"quantization \(gptq 4-bit, group 128, symmetric \(v1 zeros\)"):
        resolve_scheme("int8", gptq)
    with pytest.raises(ValueError, match=r"'w8a8' conflicts .*\(compressed-tensors fp8"):
        resolve_scheme("w8a8", fp8)


# --- packers written from the formats' definitions (python ints, one nibble at a time)

def _pack_words(values: list[int], order: tuple[int, ...] = tuple(range(8))) -> int:
    """8 nibbles -> one signed int32: nibble i holds values[order[i]]."""
    word = sum((values[order[i]] & 15) << (4 * i) for i in range(8))
    return word - (1 << 32) if word >= 1 << 31 else word


def _gptq_pack(codes: torch.Tensor, zeros: torch.Tensor, v1: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [N, K], zeros [G, N] -> qweight [K / 8, N], qzeros [G, N / 8] (v1: each word minus 0x11111111)."""
    n, k = codes.shape
    qweight = [[_pack_words(codes[c, 8 * r:8 * r + 8].tolist()) for c in range(n)] for r in range(k // 8)]
    qzeros = []
    for g in range(zeros.shape[0]):
        row = []
        for c in range(n // 8):
            word = _pack_words(zeros[g, 8 * c:8 * c + 8].tolist()) & 0xFFFFFFFF
            word = (word - 0x11111111) & 0xFFFFFFFF if v1 else word
            row.append(word - (1 << 32) if word >= 1 << 31 else word)
        qzeros.append(row)
    return torch.tensor(qweight, dtype=torch.int32), torch.tensor(qzeros, dtype=torch.int32)


@pytest.mark.parametrize("v1", [True, False])
def test_gptq_codes_and_zeros_come_back_exactly(v1: bool) -> None:
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    zeros = torch.randint(0, 16, (2, 16), dtype=torch.int32)
    zeros[0, :8] = torch.tensor([0, 15, 0, 1, 0, 0, 15, 0])  # z = 0 borrows in the v1 word: read as a whole word
    qweight, qzeros = _gptq_pack(codes, zeros, v1)
    assert torch.equal(gptq_codes(qweight), codes)
    assert torch.equal(gptq_zeros(qzeros, "v1" if v1 else "v2"), zeros)


def test_awq_columns_come_back_in_order() -> None:
    torch.manual_seed(1)
    values = torch.randint(0, 16, (3, 32), dtype=torch.uint8)
    order = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: nibble i holds column order[i]
    words = torch.tensor([[_pack_words(values[r, 8 * c:8 * c + 8].tolist(), order) for c in range(4)]
                          for r in range(3)], dtype=torch.int32)
    assert torch.equal(awq_unpack(words), values)


def test_exact_int4_layer_computes_the_checkpoint_weight_in_float32() -> None:
    """float16 scales that bfloat16 cannot hold: the layer keeps them and computes (q - z) * s exactly, on the
    packed kernel and on float32 tiles (a CPU whose compute dtype is float32); bfloat16 tiles elsewhere."""
    torch.manual_seed(2)
    n, k, group = 32, 256, 128
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    zeros = torch.randint(0, 16, (k // group, n), dtype=torch.int32)
    scales = (torch.rand(k // group, n) * 0.02 + 0.001).half()
    qweight, qzeros = _gptq_pack(codes, zeros, v1=True)
    q, pairs, size = gptq_to_int4({"qweight": qweight, "qzeros": qzeros, "scales": scales}, group, "v1")
    groups = torch.arange(k) // group
    weight = (codes.float() - zeros[groups].t().float()) * scales.float()[groups].t()
    for capability in ("avx2", None):  # float32 compute; this machine's own
        layer = ExactInt4Linear(q, pairs, size, None, dispatch_for(torch.device("cpu"), capability), None,
                                torch.float32)
        assert layer.scales_and_zeros.dtype == torch.float32 and layer.int8 is None
        assert torch.equal(layer.dequantized_weight(torch.float32), weight)
        tiles_dtype = layer.dispatch.compute_dtype
        for num_tokens in (1, 5, layer.small_batch_max_tokens + 1):
            x = torch.randn(num_tokens, k)
            exact = layer.path(num_tokens) == "packed" or tiles_dtype == torch.float32
            tol = 1e-5 if exact else 2e-2
            torch.testing.assert_close(layer(x), x @ weight.t(), rtol=tol, atol=tol * 8)
