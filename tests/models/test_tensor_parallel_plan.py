"""The tensor-parallel shard plan: per-rank sizes, the problems named with their numbers, bytes per rank."""

from __future__ import annotations

import pytest
from transformers import Gemma3TextConfig, LlamaConfig, MixtralConfig, Qwen2MoeConfig

from jobrunner.models.parallel import SINGLE, TensorParallel
from jobrunner.models.parallel.plan import rank_bytes, shard_plan, shard_problems


def smollm2_config() -> LlamaConfig:  # SmolLM2-135M's numbers
    return LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                       num_hidden_layers=30, vocab_size=49152, tie_word_embeddings=True,
                       architectures=["LlamaForCausalLM"])


def test_smollm2_splits_over_three_ranks():
    plan = shard_plan(smollm2_config(), 3)
    assert (plan.num_heads, plan.num_kv_heads, plan.kv_replicated) == (3, 1, False)
    assert (plan.intermediate_size, plan.vocab_per_rank, plan.padded_vocab) == (512, 16384, 49152)
    assert [plan.kv_head_start(r) for r in range(3)] == [0, 1, 2]
    assert shard_problems(smollm2_config(), 3) == []


def test_problems_name_the_numbers():
    assert shard_problems(smollm2_config(), 2) == [
        "num_attention_heads 9 is not divisible by tensor_parallel_size 2",
        "num_key_value_heads 3 is not divisible by tensor_parallel_size 2",
    ]
    with pytest.raises(ValueError, match="num_attention_heads 9 is not divisible by tensor_parallel_size 2"):
        shard_plan(smollm2_config(), 2)
    config = LlamaConfig(hidden_size=64, intermediate_size=100, num_attention_heads=8, num_key_value_heads=2,
                         vocab_size=101, architectures=["LlamaForCausalLM"])
    assert shard_problems(config, 8) == ["intermediate_size 100 is not divisible by tensor_parallel_size 8"]
    config.num_key_value_heads = 3
    config.num_attention_heads = 12
    assert "tensor_parallel_size 4 is not a multiple of num_key_value_heads 3" in shard_problems(config, 4)[0]
    assert shard_problems(config, 0) == ["tensor_parallel_size must be at least 1, got 0"]


def test_fewer_kv_heads_than_ranks_replicates_them():
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2,
                         vocab_size=101, architectures=["LlamaForCausalLM"])
    plan = shard_plan(config, 4)
    assert (plan.num_heads, plan.num_kv_heads, plan.kv_replicated) == (2, 1, True)
    assert [plan.kv_head_start(r) for r in range(4)] == [0, 0, 1, 1]
    assert (plan.vocab_per_rank, plan.padded_vocab) == (26, 104)  # 101 padded to a multiple of 4


def test_moe_experts_split_whole():
    mixtral = MixtralConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                            num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2, vocab_size=128,
                            architectures=["MixtralForCausalLM"])
    plan = shard_plan(mixtral, 2)
    assert (plan.num_experts, plan.expert_start(1)) == (2, 2)
    assert shard_problems(mixtral, 4) == []
    mixtral.num_local_experts = 6
    assert shard_problems(mixtral, 4) == ["num_experts 6 is not divisible by tensor_parallel_size 4"]
    qwen = Qwen2MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
                          num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                          shared_expert_intermediate_size=42, vocab_size=128, architectures=["Qwen2MoeForCausalLM"])
    plan = shard_plan(qwen, 2)
    assert (plan.shared_expert_intermediate_size, plan.intermediate_size) == (21, 96)  # no dense layer: not split
    assert shard_problems(qwen, 4) == ["shared_expert_intermediate_size 42 is not divisible by tensor_parallel_size 4"]


def test_gemma3_plan():
    config = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
                              head_dim=16, num_hidden_layers=2, vocab_size=262, architectures=["Gemma3ForCausalLM"])
    plan = shard_plan(config, 2)
    assert (plan.num_heads, plan.num_kv_heads, plan.kv_replicated, plan.vocab_per_rank) == (2, 1, True, 131)


def test_rank_bytes_split_and_replicated():
    config = smollm2_config()
    whole = rank_bytes(config, 1, 2)
    three = rank_bytes(config, 3, 2)
    assert whole["weights_bytes"] == whole["whole_bytes"] == three["whole_bytes"]
    assert three["replicated_bytes"] == whole["replicated_bytes"]  # norms: 61 x 576 x 2 bytes
    assert three["replicated_bytes"] == 61 * 576 * 2
    assert three["weights_bytes"] == three["split_bytes"] + three["replicated_bytes"]
    assert three["split_bytes"] * 3 == whole["split_bytes"]  # every split part divides exactly here
    int8 = rank_bytes(config, 3, 2, "int8")
    assert int8["weights_bytes"] < three["weights_bytes"] * 0.6


def test_tensor_parallel_single():
    assert (SINGLE.rank, SINGLE.world, SINGLE.is_parallel) == (0, 1, False)
    with pytest.raises(ValueError, match="rank 2 is not in a world of 2"):
        TensorParallel(2, 2)
