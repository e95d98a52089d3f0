"""Tiny random-weight MoE models (Qwen2-MoE, Qwen3-MoE, Mixtral) from transformers' own config classes."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
# Qwen2-MoE: shared expert, no renormalisation, layer 1 dense (mlp_only_layers); Qwen3-MoE: renormalised top-k,
# only layer 1 sparse (decoder_sparse_step=2), tied embeddings; Mixtral: always renormalised, float32 routing
# weights, every layer sparse.
MOE_KWARGS = {
    "qwen2_moe": dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=False),
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=6,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=2,
                      head_dim=16, tie_word_embeddings=True),
    "mixtral": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=32, tie_word_embeddings=False),
}
MOE_ARCHS = sorted(MOE_KWARGS)


def make_hf_moe(arch: str, vocab_size: int = 384, seed: int = 0, **overrides):
    """A transformers MoE model with larger-than-default random weights (sharp logits and routing: no near-ties)."""
    kwargs = {**COMMON, **MOE_KWARGS[arch], "vocab_size": vocab_size, **overrides}
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # projections, routers and the stacked [E, ., .] expert tensors
                p.normal_(0, 0.15)
    return model
