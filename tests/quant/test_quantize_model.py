"""quantize_model: module swap on a tiny Llama-like stack, fallbacks, errors, report bytes."""

from __future__ import annotations

import pytest
import torch

from jobrunner.quant import Int4WeightOnlyLinear, Int8WeightOnlyLinear, quantize_model
from jobrunner.quant.embedding import Int4SharedEmbedding, Int8Embedding


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(24).reshape(2, 12))


@pytest.mark.parametrize(("scheme", "cls", "max_err"), [("int8", Int8WeightOnlyLinear, 0.03),
                                                         ("int4", Int4WeightOnlyLinear, 0.2)])
def test_swaps_every_linear_and_stays_close(tiny_llama, scheme, cls, max_err) -> None:
    ref = _logits(tiny_llama)
    ids = torch.arange(96)
    embedded_before = tiny_llama.embed_tokens(ids).detach()
    # int4 keeps the head in int8 by default (test below); the override puts it in int4 to test that path
    report = quantize_model(tiny_llama, scheme, overrides={"lm_head": "int4"} if scheme == "int4" else None)
    assert not any(type(m) in (torch.nn.Linear, torch.nn.Embedding) for m in tiny_llama.modules())
    assert isinstance(tiny_llama.layers[0].qkv_proj, cls) and isinstance(tiny_llama.lm_head, cls)
    assert tiny_llama.layers[0].qkv_proj.bias is not None  # Qwen2-style qkv bias kept
    embed = tiny_llama.embed_tokens
    err = ((embed(ids) - embedded_before).norm() / embedded_before.norm()).item()
    assert embed.weight.shape == (96, 64) and embed.weight.dtype == torch.float32  # the engine reads it
    if scheme == "int8":  # the tied head and the embedding share one int8 tensor
        assert isinstance(embed, Int8Embedding) and embed.weight_int8 is tiny_llama.lm_head.weight_int8
        assert err < 0.01
    else:  # CPU: lookups read the head's packed int4 weight
        assert isinstance(embed, Int4SharedEmbedding)
        assert embed.weight_int4pack is tiny_llama.lm_head.weight_int4pack
        assert err < 0.12
        exact = tiny_llama.lm_head.dequantized_weight()[ids]
        assert torch.allclose(embed(ids), exact, atol=1e-5)
    assert report.scheme_counts() == {scheme: 9} and not report.fallbacks
    assert any("tied" in note for note in report.notes)
    err = ((_logits(tiny_llama) - ref).norm() / ref.norm()).item()
    assert err < max_err


def test_none_changes_nothing(tiny_llama) -> None:
    ref = _logits(tiny_llama)
    report = quantize_model(tiny_llama, "none")
    assert torch.equal(_logits(tiny_llama), ref)
    assert report.model_bytes_after == report.model_bytes_before
    assert report.scheme_counts() == {"none": 9}


def test_unknown_scheme_lists_choices(tiny_llama) -> None:
    with pytest.raises(ValueError, match=r"none\|int8\|int4\|fp8"):
        quantize_model(tiny_llama, "nf4")
    with pytest.raises(ValueError, match="group_size"):
        quantize_model(tiny_llama, "int4", group_size=48)


def test_skip_keeps_float(tiny_llama) -> None:
    report = quantize_model(tiny_llama, "int8", skip=["lm_head", "*.down_proj"])
    assert type(tiny_llama.lm_head) is torch.nn.Linear
    assert type(tiny_llama.embed_tokens) is torch.nn.Embedding  # tied to a float head: stays float
    assert tiny_llama.lm_head.weight is tiny_llama.embed_tokens.weight
    assert type(tiny_llama.layers[1].down_proj) is torch.nn.Linear
    assert report.scheme_counts() == {"int8": 6, "none": 3}


def test_odd_shapes_fall_back_with_reasons() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 50), torch.nn.Linear(48, 32), torch.nn.Linear(576, 64))
    report = quantize_model(model, "int4", group_size=128)
    by_name = {layer.name: layer for layer in report.layers}
    assert by_name["0"].scheme == "int8" and "multiple of 16" in by_name["0"].fallback_reason
    assert by_name["1"].scheme == "int8" and "group size" in by_name["1"].fallback_reason
    assert by_name["2"].scheme == "int4" and by_name["2"].group_size == 64  # 576 = 9 x 64
    assert "used 64" in by_name["2"].fallback_reason
    assert isinstance(model[0], Int8WeightOnlyLinear) and isinstance(model[2], Int4WeightOnlyLinear)
    x = torch.randn(3, 64)
    assert torch.isfinite(model[0](x)).all()
    assert {f["name"] for f in report.summary()["fallbacks"]} == {"0", "1", "2"}


def test_report_bytes(tiny_llama) -> None:
    report = quantize_model(tiny_llama, "int8")
    assert report.linear_bf16_bytes == sum(layer.shape[0] * layer.shape[1] * 2 for layer in report.layers)
    assert report.linear_bytes_after <= 0.55 * report.linear_bf16_bytes
    assert report.model_bytes_before > 0 and report.model_bf16_bytes > 0
    summary = report.summary()
    assert summary["linear_ratio_vs_bf16"] <= 0.55 and summary["layers"] == {"int8": 9}


def test_untied_embedding_gets_own_int8_rows_and_model_bytes_shrink() -> None:
    from tests.quant.conftest import TinyLlama

    model = TinyLlama(tied=False, hidden=128, inter=256).eval()
    report = quantize_model(model, "int4")
    assert isinstance(model.embed_tokens, Int8Embedding)
    assert model.embed_tokens.weight_int8.shape == (96, 128)
    assert report.model_bytes_after < 0.3 * report.model_bytes_before  # float32 model in, int4/int8 out
    no_embed = TinyLlama(tied=False).eval()
    quantize_model(no_embed, "int8", quantize_embeddings=False)
    assert type(no_embed.embed_tokens) is torch.nn.Embedding


def test_int4_keeps_the_tied_head_in_int8_unless_overridden(tiny_llama) -> None:
    report = quantize_model(tiny_llama, "int4")
    assert isinstance(tiny_llama.lm_head, Int8WeightOnlyLinear)
    assert isinstance(tiny_llama.layers[0].down_proj, Int4WeightOnlyLinear)
    assert tiny_llama.embed_tokens.weight_int8 is tiny_llama.lm_head.weight_int8
    assert report.scheme_counts() == {"int4": 8, "int8": 1} and not report.fallbacks
    assert any("lm_head stored in int8 under int4" in note for note in report.notes)
    from tests.quant.conftest import TinyLlama

    skipped = TinyLlama().eval()
    report = quantize_model(skipped, "int4", skip=("lm_head",))  # skip beats the int8 default
    assert type(skipped.lm_head) is torch.nn.Linear and report.scheme_counts() == {"int4": 8, "none": 1}
    report = quantize_model(TinyLlama().eval(), "int4", overrides={"*head": "int4"})  # so does an override
    assert report.scheme_counts() == {"int4": 9}
    with pytest.raises(ValueError, match="unknown quantization scheme"):
        quantize_model(tiny_llama, "int4", overrides={"lm_head": "int2"})
