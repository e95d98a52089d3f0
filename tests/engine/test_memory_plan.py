"""The memory plan's arithmetic (injected numbers: the CUDA path cannot run here), the CPU breakdown, and the
profile step run on the CPU through the engine's own scheduler and runner."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.tiny import make_hf_model, make_tokenizer  # noqa: E402

from jobrunner.engine import EngineConfig  # noqa: E402
from jobrunner.engine.llm_engine import LLMEngine  # noqa: E402
from jobrunner.engine.memory_plan import (  # noqa: E402
    CPU_KV_DEFAULT_BYTES,
    estimate_activation_bytes,
    kv_budget_bytes,
    plan_from_numbers,
    profile_lengths,
)
from jobrunner.engine.profile_run import profile_step  # noqa: E402
from jobrunner.models.loader import build_model, load_weights  # noqa: E402

GB = 10**9
H100 = 85_031_714_816  # torch.cuda.mem_get_info's total on an 80 GB H100


def test_kv_is_the_share_of_the_card_less_weights_activations_graphs():
    assert kv_budget_bytes(100 * GB, 0.9, 1.0, 16 * GB, 2 * GB, 1 * GB) == 71 * GB
    assert kv_budget_bytes(100 * GB, 0.9, 0.5, 16 * GB, 2 * GB, 1 * GB, other_bytes=GB) == 25 * GB  # half a card
    plan = plan_from_numbers(device="cuda:0", total_bytes=H100, free_bytes=H100 - 17 * GB, utilization=0.85,
                             share=1.0, weights_bytes=16 * GB, activations_bytes=GB // 2, graphs_bytes=GB // 4,
                             kv_bytes_per_block=2 * 1024**2)
    budget = int(0.85 * H100)
    assert plan.budget_bytes == budget and plan.num_kv_blocks == (budget - 16_750_000_000) // (2 * 1024**2)
    assert plan.kv_bytes == plan.num_kv_blocks * 2 * 1024**2 and plan.how == "profiled" and not plan.note
    info = plan.to_info()
    assert info["memory_weights_bytes"] == 16 * GB and info["memory_activations_bytes"] == GB // 2
    assert info["memory_graphs_bytes"] == GB // 4 and info["memory_kv_bytes"] == plan.kv_bytes
    assert info["memory_plan"].startswith("weights 16.00 GB, activations 0.50 GB, graphs 0.25 GB, KV ")


def test_two_half_workers_each_get_their_own_share():
    """A fractional worker plans on its share of the card, not on what the other one left free."""
    common = dict(device="cuda:0", total_bytes=80 * GB, utilization=0.9, share=0.5, weights_bytes=10 * GB,
                  activations_bytes=GB, graphs_bytes=0, kv_bytes_per_block=GB // 1000)
    first = plan_from_numbers(free_bytes=70 * GB, **common)  # the other worker not started yet
    second = plan_from_numbers(free_bytes=70 * GB - 36 * GB, **common)  # started after the first took its 36
    assert first.kv_bytes == second.kv_bytes == 25 * GB and first.budget_bytes == 36 * GB


def test_what_is_free_caps_the_plan_and_no_room_is_named():
    plan = plan_from_numbers(device="cuda:0", total_bytes=80 * GB, free_bytes=20 * GB, utilization=0.9,
                             share=1.0, weights_bytes=10 * GB, activations_bytes=GB, graphs_bytes=GB,
                             kv_bytes_per_block=GB // 100)
    assert plan.kv_bytes == 19 * GB and "capped by the 20.00 GB free" in plan.note
    with pytest.raises(ValueError, match=r"no room for the KV cache on cuda:0.*weights 70\.00 GB"):
        plan_from_numbers(device="cuda:0", total_bytes=80 * GB, free_bytes=10 * GB, utilization=0.9, share=1.0,
                          weights_bytes=70 * GB, activations_bytes=2 * GB, graphs_bytes=0, kv_bytes_per_block=GB)


def test_profile_lengths_fill_the_token_budget():
    assert profile_lengths(2048, 64, 8192) == [32] * 64
    assert profile_lengths(10, 4, 100) == [3, 3, 2, 2]
    assert profile_lengths(2048, 1, 512) == [512] * 4  # no prompt longer than the model's context
    assert profile_lengths(8, 64, 100) == [1] * 8


def test_activation_estimate_formula():
    hf = make_hf_model("llama")
    model = build_model(hf.config, torch.float32, torch.device("meta"))
    # per token: 4 x 64 (residual, norm, attention out, o) + q 64 + k, v 2 x 32 + 3 x 128 (gate|up, product)
    assert estimate_activation_bytes(model.shape, 100, 8, 4) == 100 * (256 + 64 + 64 + 384) * 4 + 2 * 8 * 384 * 4


def _tiny_model():
    hf = make_hf_model("llama")
    model = build_model(hf.config, torch.float32, torch.device("cpu"))
    load_weights(model, hf.state_dict().items())
    return model


def test_profile_step_runs_the_worst_step_through_the_engine():
    config = EngineConfig(device="cpu", max_num_batched_tokens=300, max_num_seqs=7)
    result = profile_step(_tiny_model(), config, torch.device("cpu"), 512)
    assert (result.peak_bytes, result.num_tokens, result.num_sampled) == (0, 300, 7)


def test_cpu_engine_records_its_breakdown():
    model = _tiny_model()
    tok = make_tokenizer()
    engine = LLMEngine(model, tok, EngineConfig(device="cpu", kv_cache_memory_bytes=3 * 2**20))
    info, per_block = engine.model_info, 2 * 2 * 2 * 16 * 16 * 4  # layers x K,V x kv heads x dim x block x f32
    assert info["memory_kv_bytes_per_block"] == per_block
    assert info["memory_num_kv_blocks"] == 3 * 2**20 // per_block == engine.kv_manager.num_blocks
    assert info["memory_how"] == "cpu: engine.kv_cache_memory_bytes" and info["memory_graphs_bytes"] == 0
    assert info["memory_weights_bytes"] == sum(t.numel() * 4 for t in {id(t): t for t in
                                                                      [*model.parameters(), *model.buffers()]}.values())
    default = LLMEngine(_tiny_model(), tok, EngineConfig(device="cpu")).model_info
    assert default["memory_kv_bytes"] == CPU_KV_DEFAULT_BYTES // per_block * per_block
