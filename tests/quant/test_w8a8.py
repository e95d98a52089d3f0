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
from jobrunner.quant.int8 import Int8WeightOnlyLinear  # noqa: E402
from jobrunner.quant.w8a8 import W8A8Linear, quantize_rows, w8a8_reference  # noqa: E402

VNNI = torch.cpu._is_vnni_supported()
KERNELS = ["int_mm", pytest.param("onednn", marks=pytest.mark.skipif(
    not VNNI, reason="oneDNN's u8 x s8 GEMM is exact only with VNNI / AMX-INT8 (dispatch never picks it elsewhere)"))]


@pytest.mark.parametrize("kernel", KERNELS)
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
    expected = w8a8_reference(x, layer.weight_int8, layer.scales) + linear.bias.double()
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (tokens, 48)
    assert ((y.double() - expected).abs().max() / expected.abs().max()).item() < 1e-5
    assert torch.allclose(y[0], linear.bias)
    # a row's result does not depend on its neighbours (per-token scales)
    assert torch.equal(layer(x[-1:]), y[-1:])
    # bf16 activations in, bf16 out (the engine's dtype on fast-bf16 CPUs)
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    # decode at batch 1 may take the int8 weight-only kernel: the same weights, float (bf16) activations
    layer.weight_only_tokens = 1
    single = x[-1:]
    weight_only = single.double() @ layer.dequantized_weight(torch.float64).t() + linear.bias.double()
    assert ((layer(single).double() - weight_only).abs().max() / weight_only.abs().max()).item() < 2e-2


def test_quantize_rows_is_symmetric_per_token() -> None:
    x = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [254.0, 127.0, -1.0]])
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and q.tolist() == [[64, -127, 32], [0, 0, 0], [127, 64, 0]]
    assert torch.allclose(scale.squeeze(1), torch.tensor([1 / 127, 1.0, 2.0]))


@pytest.mark.parametrize("capability", CPU_CAPABILITIES)
def test_w8a8_dispatch_for_each_forced_capability(capability: str, tiny_llama) -> None:
    """oneDNN's int8 GEMM with int8 dot-product hardware (VNNI / AMX); elsewhere int8 weight-only, said why."""
    expected = "onednn" if capability in ("avx512_vnni", "avx512_bf16", "amx") else None
    assert dispatch_for("cpu", capability).w8a8_kernel == expected
    report = quantize_model(tiny_llama, "w8a8", capability=capability)
    assert report.dispatch["w8a8_kernel"] == expected
    layers = [m for m in tiny_llama.modules() if isinstance(m, (W8A8Linear, Int8WeightOnlyLinear))]
    assert len(layers) == 9  # 4 per block x 2 + lm_head
    if expected:  # down_proj stays weight-only (outlier activations), with the reason
        down = {f"layers.{i}.down_proj" for i in range(2)}
        assert all(isinstance(m, W8A8Linear) and m.kernel == "onednn" and m.weight_only_tokens == 1
                   for n, m in tiny_llama.named_modules() if n in {x.name for x in report.layers} - down)
        assert report.scheme_counts() == {"w8a8": 7, "int8": 2}
        assert {f.name for f in report.fallbacks} == down
        assert describe_dispatch(report.dispatch).endswith("; w8a8 via onednn")
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
        assert scheme == "none" or report.scheme_counts()["w8a8"] == len(report.layers) - 2  # 2 down_proj
        engines[scheme] = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=32, enable_prefix_caching=False),
                                    eos_token_ids=[tokenizer.eos_token_id])
    worst = 0.0
    for text in ("The quick brown fox", "Natalia sold clips to 48 of her friends"):
        ids = tokenizer(text)["input_ids"]
        float_lp, w8a8_lp = (torch.tensor(engines[s].prompt_logprobs(ids)) for s in ("none", "w8a8"))
        worst = max(worst, (float_lp - w8a8_lp).abs().max().item())
    assert 0.0 < worst < 0.15
