"""Sharded loading, in one process (no collective runs while loading): each rank's parameters are its rows /
columns of the checkpoint's tensors, put together they are the whole model's; int8 row-parallel shards carry the
whole rows' codes and scales; what is refused at world > 1, with the numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jobrunner.models.loader import build_model, load_weights
from jobrunner.models.parallel import TensorParallel
from jobrunner.models.weights import Checkpoint
from jobrunner.quant.at_load import QuantizeAtLoad
from tests.engine.tiny import make_hf_model
from tests.engine.tiny_moe import make_hf_moe

FIXTURES = Path(__file__).resolve().parents[1] / "quant" / "fixtures"


def saved(tmp_path_factory, name: str, hf) -> tuple[object, Path]:
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path, max_shard_size="40KB", safe_serialization=True)
    return hf.config, path


def load(config, path: Path, rank: int | None, world: int = 2, quantization: str = "none") -> torch.nn.Module:
    tp = None if rank is None else TensorParallel(rank, world)
    model = build_model(config, torch.float32, torch.device("cpu"), materialize=False, tensor_parallel=tp)
    transform = QuantizeAtLoad(model, quantization, torch.device("cpu")) if quantization != "none" else None
    load_weights(model, Checkpoint(path), device="cpu", transform=transform)
    return model


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):  # q|k|v bias, untied, vocabulary 385: padded to 386 over 2 ranks
    return saved(tmp_path_factory, "qwen2", make_hf_model("qwen2", vocab_size=385))


def test_rank_shards_put_together_are_the_whole(qwen2):
    config, path = qwen2
    whole = load(config, path, None).state_dict()
    ranks = [load(config, path, r).state_dict() for r in range(2)]
    assert ranks[0]["embed_tokens.weight"].shape == (193, 64)
    assert torch.equal(torch.cat([r["embed_tokens.weight"] for r in ranks])[:385], whole["embed_tokens.weight"])
    assert torch.equal(ranks[1]["lm_head.weight"][-1], torch.zeros(64))  # the padding row
    hd, q, kv = 16, 64, 32  # 4 q heads, 2 KV heads of 16
    for name in ("layers.0.self_attn.qkv_proj.weight", "layers.1.self_attn.qkv_proj.bias"):
        parts = [r[name].split([q // 2, kv // 2, kv // 2]) for r in ranks]
        for i in range(3):
            assert torch.equal(torch.cat([p[i] for p in parts]), whole[name].split([q, kv, kv])[i]), (name, i)
    assert torch.equal(torch.cat([r["layers.0.self_attn.o_proj.weight"] for r in ranks], 1),
                       whole["layers.0.self_attn.o_proj.weight"])
    assert torch.equal(torch.cat([r["layers.0.mlp.down_proj.weight"] for r in ranks], 1),
                       whole["layers.0.mlp.down_proj.weight"])
    gate_up = [r["layers.0.mlp.gate_up_proj.weight"].chunk(2) for r in ranks]
    whole_gate_up = whole["layers.0.mlp.gate_up_proj.weight"].chunk(2)
    for half in range(2):
        assert torch.equal(torch.cat([g[half] for g in gate_up]), whole_gate_up[half])
    assert torch.equal(ranks[1]["norm.weight"], whole["norm.weight"])
    assert hd == config.hidden_size // config.num_attention_heads


def test_each_rank_loads_its_experts(tmp_path_factory):
    config, path = saved(tmp_path_factory, "mixtral", make_hf_moe("mixtral"))  # 4 experts: 2 per rank
    whole = load(config, path, None).state_dict()
    for rank in range(2):
        shard = load(config, path, rank).state_dict()
        for name in ("layers.0.mlp.experts.gate_up_proj", "layers.2.mlp.experts.down_proj"):
            assert torch.equal(shard[name], whole[name][2 * rank:2 * rank + 2])
        assert torch.equal(shard["layers.0.mlp.gate.weight"], whole["layers.0.mlp.gate.weight"])  # router


def test_int8_row_parallel_shards_keep_the_whole_rows_codes(qwen2):
    config, path = qwen2
    whole = load(config, path, None, quantization="int8").state_dict()
    for rank in range(2):
        shard = load(config, path, rank, quantization="int8").state_dict()
        for name, width in (("layers.0.self_attn.o_proj", 32), ("layers.1.mlp.down_proj", 64)):
            cols = slice(rank * width, (rank + 1) * width)
            assert torch.equal(shard[f"{name}.weight_int8"], whole[f"{name}.weight_int8"][:, cols]), name
            assert torch.equal(shard[f"{name}.scales"], whole[f"{name}.scales"]), name
        rows = slice(rank * 32, (rank + 1) * 32)  # column-parallel: q rows quantize as they did whole
        assert torch.equal(shard["layers.0.self_attn.qkv_proj.scales"][:32],
                           whole["layers.0.self_attn.qkv_proj.scales"][rows])


def test_a_model_that_does_not_divide_is_refused_naming_the_numbers(qwen2):
    config, _ = qwen2
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by tensor_parallel_size 3"):
        build_model(config, torch.float32, torch.device("cpu"), tensor_parallel=TensorParallel(0, 3))


def test_prequantized_checkpoint_loads_its_shard():
    """A pre-quantized checkpoint loads sharded (its packed tensors cut per rank: test_tensor_parallel_prequantized)."""
    from jobrunner.models.factory import load_for_engine

    model, _, _, info = load_for_engine(str(FIXTURES / "fp8-channel"), dtype="float32", device="cpu",
                                        tensor_parallel=TensorParallel(1, 2))
    assert info["tensor_parallel"] == {"rank": 1, "world": 2}
    assert info["checkpoint_quantization"].startswith("compressed-tensors fp8")
    o_proj = model.get_submodule("layers.0.self_attn.o_proj")
    assert (o_proj.out_features, o_proj.in_features) == (128, 64)


def test_lora_adapters_are_refused(qwen2, tmp_path):
    from jobrunner.bench.lora_steps import write_random_adapter
    from jobrunner.models.lora import load_adapters

    config, path = qwen2
    write_random_adapter(tmp_path / "a", load(config, path, None), 4, 0)
    with pytest.raises(ValueError, match="LoRA adapters are not supported with tensor_parallel_size 2"):
        load_adapters(load(config, path, 0), {"a": (str(tmp_path / "a"), tmp_path / "a")})


def test_phi3_fused_checkpoint_tensors_are_cut_per_part(tmp_path_factory):
    """Phi-3 stores q|k|v and gate|up fused: each is cut into its parts, then each part to the rank's rows."""
    config, path = saved(tmp_path_factory, "phi3", make_hf_model("phi3"))
    whole = load(config, path, None).state_dict()
    ranks = [load(config, path, r).state_dict() for r in range(2)]
    name = "layers.1.self_attn.qkv_proj.weight"
    parts = [r[name].split([32, 16, 16]) for r in ranks]
    for i in range(3):
        assert torch.equal(torch.cat([p[i] for p in parts]), whole[name].split([64, 32, 32])[i])
    name = "layers.0.mlp.gate_up_proj.weight"
    for half in range(2):
        assert torch.equal(torch.cat([r[name].chunk(2)[half] for r in ranks]), whole[name].chunk(2)[half])
