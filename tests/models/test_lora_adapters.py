"""LoRA adapter files and layers without peft: fetching a PEFT directory from a storage URL, what is refused (by
adapter and field or key), and a wrapped layer's output over a float, packed or quantized base layer equal to
the base output plus the adapter's update, row by row, in a batch where rows of two adapters are interleaved."""

from __future__ import annotations

import json
import math

import fsspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from jobrunner.bench.lora_steps import write_random_adapter
from jobrunner.engine.adapters import load_adapters_onto
from jobrunner.models.adapter_sources import check_adapter_source, resolve_adapter_dir
from jobrunner.models.loader import build_model, load_weights
from jobrunner.models.sources import ModelSourceError
from jobrunner.models.weights import iter_safetensors, load_config
from tests.components import require_library

KEY = "base_model.model.model.layers.{}.{}.lora_{}.weight"


@pytest.fixture
def tiny_model(tiny_llama_hf_dir):
    def make():
        model = build_model(load_config(tiny_llama_hf_dir), torch.float32, torch.device("cpu"))
        load_weights(model, iter_safetensors(tiny_llama_hf_dir))
        return model
    return make


def _adapter(tmp_path, model, name: str, seed: int, rank: int = 4, **config) -> str:
    path = tmp_path / name
    write_random_adapter(path, model, rank, seed)
    if config:
        saved = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**saved, **config}))
    return str(path)


def test_adapter_fetched_from_a_storage_url(tmp_path, tiny_model):
    local = _adapter(tmp_path, tiny_model(), "a", 0)
    fs = fsspec.filesystem("memory")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        fs.put_file(f"{local}/{name}", f"/lora-test/a/{name}")
    fetched = resolve_adapter_dir("a", "memory://lora-test/a", cache_dir=str(tmp_path / "cache"))
    assert fetched != local and (fetched / "adapter_model.safetensors").read_bytes() == \
        (tmp_path / "a" / "adapter_model.safetensors").read_bytes()
    with pytest.raises(ModelSourceError, match=r"adapter 'b'.*memory://lora-test/none.*could not copy"):
        resolve_adapter_dir("b", "memory://lora-test/none", cache_dir=str(tmp_path / "cache"))
    assert "r=4" in check_adapter_source("a", local)
    with pytest.raises(ModelSourceError, match="adapter 'x'"):
        check_adapter_source("x", str(tmp_path / "missing"))


@pytest.mark.parametrize("field, value", [("modules_to_save", ["lm_head"]), ("use_dora", True),
                                          ("peft_type", "IA3"), ("bias", "all")])
def test_unsupported_config_fields_are_refused(tmp_path, tiny_model, field, value):
    model = tiny_model()
    path = _adapter(tmp_path, model, "bad", 0, **{field: value})
    with pytest.raises(ValueError, match=rf"adapter 'bad': .*{field}"):
        load_adapters_onto(model, {"bad": path})


def test_embedding_targets_and_foreign_shapes_are_refused(tmp_path, tiny_model):
    model = tiny_model()
    path = tmp_path / _adapter(tmp_path, model, "emb", 0)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    save_file({**tensors, "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 300)},
              str(path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"adapter 'emb': tensor .*embed_tokens.*not supported"):
        load_adapters_onto(model, {"emb": str(path)})
    tensors[KEY.format(0, "self_attn.q_proj", "A")] = torch.zeros(4, 32)  # another hidden size
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"adapter 'emb': model.layers.0.self_attn.q_proj.*another base model"):
        load_adapters_onto(tiny_model(), {"emb": str(path)})


@pytest.mark.parametrize("quantization", ["none", "packed", "int8"])
def test_wrapped_layer_adds_each_rows_adapter(tmp_path, tiny_model, quantization):
    model = tiny_model()
    if quantization == "int8":
        from jobrunner.quant import quantize_model

        quantize_model(model, "int8")
    elif quantization == "packed":
        from jobrunner.models.packed_linear import PackedLinear, packed_library

        lib = require_library(packed_library())  # a portable build exists for every CPU: a failed one fails
        model.layers[1].self_attn.qkv_proj = PackedLinear(model.layers[1].self_attn.qkv_proj, lib)
    paths = {"a": _adapter(tmp_path, model, "a", 1, rank=4, use_rslora=True),
             "b": _adapter(tmp_path, model, "b", 2, rank=8, lora_alpha=4)}
    base_layer = model.layers[1].self_attn.qkv_proj
    adapters = load_adapters_onto(model, paths)
    layer = model.layers[1].self_attn.qkv_proj
    assert layer.base is base_layer
    x = torch.randn(6, 64)
    row_adapters = [1, 2, 0, 1, 2, 1]  # rows of a, b and the base model interleaved
    groups = adapters.token_groups(row_adapters, list(range(6)), [1] * 6, torch.device("cpu"))
    with torch.inference_mode():
        expected = base_layer(x)
        with adapters.step(groups):
            got = layer(x)
        assert torch.equal(layer(x), expected)  # outside a step: the base model
    expected = expected.clone()  # out of inference mode
    for row, adapter_id in enumerate(row_adapters):
        if adapter_id:
            expected[row] += _peft_update(paths["ab"[adapter_id - 1]], x[row], adapter_id == 1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _peft_update(path: str, x: torch.Tensor, rslora: bool) -> torch.Tensor:
    """Layer 1's q|k|v update of one row, as PEFT defines it (B A x * alpha / r), from the files."""
    tensors = load_file(f"{path}/adapter_model.safetensors")
    config = json.loads(open(f"{path}/adapter_config.json").read())
    parts = []
    for module in ("q_proj", "k_proj", "v_proj"):
        a, b = (tensors[KEY.format(1, f"self_attn.{module}", w)] for w in "AB")
        r = a.shape[0]
        parts.append(b @ (a @ x) * config["lora_alpha"] / (math.sqrt(r) if rslora else r))
    return torch.cat(parts)
