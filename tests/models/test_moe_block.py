"""The MoE block alone: routing as transformers computes it (dtypes, casting order), tokens grouped by expert
(one GEMM pair per active expert, none for an expert without tokens), fixed row tiles for deterministic mode."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, MixtralTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock, Qwen2MoeTopKRouter

from jobrunner.models.llama import MLP, ModelShape
from jobrunner.models.moe import MoeShape, SparseMoeBlock, StackedExperts, route

HIDDEN, INTER = 32, 16


def _experts(num_experts: int = 4, seed: int = 0) -> StackedExperts:
    torch.manual_seed(seed)
    experts = StackedExperts(num_experts, HIDDEN, INTER)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    return experts


def _reference(experts: StackedExperts, x, weights, expert_ids) -> torch.Tensor:
    """Token by token, slot by slot: what the grouped forward must equal."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(expert_ids.shape[1]):
            e = int(expert_ids[t, k])
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            out[t] += weights[t, k] * (experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def _count_gemms(experts: StackedExperts, monkeypatch) -> list[tuple[int, int]]:
    calls = []
    original = experts._expert_untiled

    def counted(expert, rows):
        calls.append((expert, rows.shape[0]))
        return original(expert, rows)

    monkeypatch.setattr(experts, "_expert_untiled", counted)
    return calls


@pytest.mark.parametrize("case", ["mixed, expert 2 without tokens", "all on one expert", "no tokens"])
def test_grouped_experts_equal_the_per_token_reference(case, monkeypatch):
    experts = _experts()
    torch.manual_seed(1)
    num_tokens = 0 if case == "no tokens" else 9
    x = torch.randn(num_tokens, HIDDEN)
    if case == "all on one expert":
        expert_ids = torch.full((num_tokens, 1), 3)
    else:
        expert_ids = torch.tensor([[0, 1], [3, 0], [1, 3], [0, 3], [1, 0], [3, 1], [0, 1], [1, 3], [3, 0]])[:num_tokens]
    weights = torch.rand(num_tokens, expert_ids.shape[1])
    calls = _count_gemms(experts, monkeypatch)
    with torch.no_grad():
        out = experts(x, weights, expert_ids)
        expected = _reference(experts, x, weights, expert_ids)
    assert out.shape == (num_tokens, HIDDEN)
    assert torch.allclose(out, expected, atol=1e-5)
    counts = torch.bincount(expert_ids.reshape(-1), minlength=4).tolist()
    # one GEMM pair per expert that has tokens, over all of its tokens at once; none for the others
    assert calls == [(e, n) for e, n in enumerate(counts) if n]


def test_fixed_row_tiles_make_a_row_independent_of_the_others():
    experts = _experts()
    experts.row_tile = 8
    torch.manual_seed(2)
    x = torch.randn(21, HIDDEN)
    expert_ids = torch.randint(0, 4, (21, 2))
    weights = torch.rand(21, 2)
    with torch.no_grad():
        batch = experts(x, weights, expert_ids)
        alone = torch.cat([experts(x[i:i + 1], weights[i:i + 1], expert_ids[i:i + 1]) for i in range(21)])
        assert torch.equal(batch, alone)  # bit for bit, whatever else the step routed to the same experts
        experts.row_tile = None
        assert torch.allclose(experts(x, weights, expert_ids), batch, atol=1e-6)


def _hf_config(model_type: str, **kwargs):
    common = dict(hidden_size=HIDDEN, intermediate_size=INTER, num_experts_per_tok=2, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=64, experts_implementation="eager")
    return AutoConfig.for_model(model_type, **common, **kwargs)


@pytest.mark.parametrize("normalize", [False, True])
def test_qwen_routing_matches_transformers_in_bfloat16(normalize):
    config = _hf_config("qwen2_moe", num_experts=8, moe_intermediate_size=INTER, norm_topk_prob=normalize)
    torch.manual_seed(3)
    router = Qwen2MoeTopKRouter(config).to(torch.bfloat16)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        x = torch.randn(40, HIDDEN, dtype=torch.bfloat16)
        logits, their_weights, their_ids = router(x)
        weights, ids = route(logits, 2, normalize, float32_weights=False)
    assert weights.dtype == torch.bfloat16  # Qwen: the k weights cast back to the compute dtype
    assert torch.equal(ids, their_ids) and torch.equal(weights, their_weights)
    sums = weights.float().sum(-1)
    assert torch.allclose(sums, torch.ones(40), atol=1e-2) if normalize else bool((sums < 0.999).all())


def test_mixtral_routing_matches_transformers_in_bfloat16():
    config = _hf_config("mixtral", num_local_experts=8)
    torch.manual_seed(4)
    router = MixtralTopKRouter(config).to(torch.bfloat16)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        x = torch.randn(40, HIDDEN, dtype=torch.bfloat16)
        logits, their_weights, their_ids = router(x)
        weights, ids = route(logits, 2, True, float32_weights=True)
    assert weights.dtype == torch.float32  # Mixtral: renormalised float32 weights scale the outputs
    assert torch.equal(ids, their_ids) and torch.equal(weights, their_weights)


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_matches_transformers_block(arch, dtype):
    """The whole block (router, experts, Qwen2-MoE's sigmoid-gated shared expert) against transformers' own,
    weights copied across; bf16 within one rounding of the output (the k slots are summed in another order)."""
    if arch == "mixtral":
        config = _hf_config("mixtral", num_local_experts=6)
        theirs = MixtralSparseMoeBlock(config)
        moe = MoeShape(6, 2, INTER, True, True, 0, (0,))
    else:
        config = _hf_config("qwen2_moe", num_experts=6, moe_intermediate_size=INTER, shared_expert_intermediate_size=24,
                            norm_topk_prob=False)
        theirs = Qwen2MoeSparseMoeBlock(config)
        moe = MoeShape(6, 2, INTER, False, False, 24, (0,))
    torch.manual_seed(5)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.2)
    shape = ModelShape(arch, HIDDEN, INTER, 1, 4, 2, 8, 64, 1e-6, 64, False, False, False, moe=moe)
    ours = SparseMoeBlock(HIDDEN, moe, MLP(shape, 24) if arch == "qwen2_moe" else None)
    state = {k: v for k, v in theirs.state_dict().items() if "shared_expert." not in k}
    if arch == "qwen2_moe":
        shared = theirs.shared_expert
        state["shared_expert.gate_up_proj.weight"] = torch.cat([shared.gate_proj.weight, shared.up_proj.weight])
        state["shared_expert.down_proj.weight"] = shared.down_proj.weight
    ours.load_state_dict(state)
    theirs, ours = theirs.to(dtype), ours.to(dtype)
    x = torch.randn(2, 11, HIDDEN, dtype=dtype)
    with torch.no_grad():
        expected = theirs(x).reshape(22, HIDDEN)
        out = ours(x.reshape(22, HIDDEN))
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.float(), expected.float(), atol=atol, rtol=0)
