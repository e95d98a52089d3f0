"""The streamed loader: parameters made on the device in the model's dtype as each tensor is read from sharded
safetensors, each layer handed to a transform the moment it is complete (quantize-at-load), the replace hook."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.tiny import make_hf_model  # noqa: E402

from jobrunner.models.load_stream import unit_of  # noqa: E402
from jobrunner.models.loader import build_model, load_weights  # noqa: E402
from jobrunner.models.weights import Checkpoint  # noqa: E402
from jobrunner.quant import quantize_model  # noqa: E402
from jobrunner.quant.at_load import QuantizeAtLoad  # noqa: E402


@pytest.fixture(scope="module", params=["llama", "llama_tied", "qwen2"])
def saved(request, tmp_path_factory):
    """A tiny random model saved as several bf16 safetensors shards (with an index), and the HF model."""
    hf = make_hf_model(request.param).to(torch.bfloat16)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, max_shard_size="40KB", safe_serialization=True)
    assert len(list(path.glob("*.safetensors"))) > 2 and (path / "model.safetensors.index.json").is_file()
    return hf, path


def _logits(model: torch.nn.Module) -> torch.Tensor:
    from engine.tiny import make_tokenizer

    from jobrunner.engine import EngineConfig
    from jobrunner.engine.llm_engine import LLMEngine
    from jobrunner.engine.sampling_params import SamplingParams

    tok = make_tokenizer()
    engine = LLMEngine(model, tok, EngineConfig(device="cpu", num_kv_blocks=64, attention_backend="torch"),
                       eos_token_ids=[tok.eos_token_id])
    out = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6, temperature=0, logprobs=3))[0]
    return out.output_token_ids, [repr(lp) for lp in out.logprobs]


def _streamed(hf, path, transform_for=None):
    model = build_model(hf.config, torch.bfloat16, torch.device("cpu"), materialize=False)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())  # dtype set on meta
    transform = transform_for(model) if transform_for else None
    load_weights(model, Checkpoint(path), device="cpu", transform=transform)
    return model, transform


def test_streamed_load_equals_the_materialised_one(saved):
    hf, path = saved
    model, _ = _streamed(hf, path)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    reference = build_model(hf.config, torch.bfloat16, torch.device("cpu"))
    load_weights(reference, hf.state_dict().items())
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), name
    if hf.config.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight
    assert _logits(model) == _logits(reference)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantize_at_load_equals_quantize_after(saved, scheme):
    """Layer by layer as it loads gives bit for bit what quantize_model gives on the loaded float model."""
    hf, path = saved
    model, transform = _streamed(hf, path, lambda m: QuantizeAtLoad(m, scheme, torch.device("cpu")))
    reference, _ = _streamed(hf, path)
    expected = quantize_model(reference, scheme)
    assert transform.report.scheme_counts() == expected.scheme_counts()
    assert transform.report.model_bytes_after == expected.model_bytes_after
    assert sorted(transform.report.notes) == sorted(expected.notes)
    got, want = model.state_dict(), reference.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in got)
    assert _logits(model) == _logits(reference)


class _Watch:
    """Wraps QuantizeAtLoad: at each unit, how many float linear weights are on the device."""

    def __init__(self, model):
        self.inner = QuantizeAtLoad(model, "int8", torch.device("cpu"))
        self.units, self.float_linears = [], []

    def replaces(self, module_name, module):
        return self.inner.replaces(module_name, module)

    def install(self, model, module_name, tensors, device):
        self.inner.install(model, module_name, tensors, device)

    def unit_loaded(self, model, unit_name):
        self.units.append(unit_name)
        self.float_linears.append(sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear)
                                      and not m.weight.is_meta))
        self.inner.unit_loaded(model, unit_name)

    def finish(self, model):
        self.inner.finish(model)


def test_each_layer_is_quantized_before_the_next_is_read(saved):
    hf, path = saved
    _, watch = _streamed(hf, path, _Watch)
    layers = [u for u in watch.units if u.startswith("layers.")]
    assert layers == ["layers.0", "layers.1"] and len(set(watch.units)) == len(watch.units)
    # when a layer is handed over, only its own 4 linears (plus an untied head read before it) are float
    for unit, count in zip(watch.units, watch.float_linears, strict=True):
        assert count <= 4 + (0 if hf.config.tie_word_embeddings else 1), (unit, count)


def test_unit_names():
    assert unit_of("layers.12.mlp.down_proj.weight") == "layers.12"
    assert unit_of("embed_tokens.weight") == "embed_tokens" and unit_of("lm_head.weight") == "lm_head"


class _ReplaceDown:
    """A replace hook as a pre-quantized format uses it: builds each down_proj from its checkpoint tensors."""

    def __init__(self):
        self.seen = {}

    def replaces(self, module_name, module):
        return module_name.endswith("mlp.down_proj")

    def install(self, model, module_name, tensors, device):
        self.seen[module_name] = sorted(tensors)
        weight = tensors[("weight", None)]
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=torch.bfloat16)
        linear.weight.data.copy_(weight.to(device))
        parent, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent), child, linear)

    def unit_loaded(self, model, unit_name):
        pass

    def finish(self, model):
        pass


def test_replace_hook_gets_its_modules_tensors(saved):
    hf, path = saved
    model, hook = _streamed(hf, path, lambda m: _ReplaceDown())
    assert hook.seen == {f"layers.{i}.mlp.down_proj": [("weight", None)] for i in range(2)}
    reference, _ = _streamed(hf, path)
    assert _logits(model) == _logits(reference)


def test_missing_and_unknown_tensors_are_named(saved):
    hf, path = saved
    tensors = dict(Checkpoint(path))
    model = build_model(hf.config, torch.bfloat16, torch.device("cpu"), materialize=False)
    missing = {k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(ValueError, match=r"missing 1 weight.*layers\.1\.mlp\.gate_up_proj\.weight#1"):
        load_weights(model, missing.items())
    model = build_model(hf.config, torch.bfloat16, torch.device("cpu"), materialize=False)
    extra = {**tensors, "model.layers.0.mlp.down_proj.qweight": torch.zeros(4, dtype=torch.int32)}
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.down_proj\.qweight' has no place"):
        load_weights(model, extra.items())


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_moe_quantize_at_load_equals_quantize_after(arch, tmp_path):
    """Stacked experts filled expert by expert from the shards, then split and quantized with their layer."""
    from engine.tiny_moe import make_hf_moe

    hf = make_hf_moe(arch).to(torch.bfloat16)
    hf.save_pretrained(tmp_path, max_shard_size="60KB", safe_serialization=True)
    model, transform = _streamed(hf, tmp_path, lambda m: QuantizeAtLoad(m, "int8", torch.device("cpu")))
    reference, _ = _streamed(hf, tmp_path)
    expected = quantize_model(reference, "int8")
    assert transform.report.scheme_counts() == expected.scheme_counts()
    got, want = model.state_dict(), reference.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in got)
