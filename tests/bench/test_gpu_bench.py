"""scripts/gpu_bench.py's budget rules, on CPU (the tool that a lent GPU runs first: a mistake found there costs
device minutes): a run's timed loop gets its share after its set-up, and parity runs the judged dtype first."""

from __future__ import annotations

import importlib.util
import time
import types
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPTS / "gpu_bench.py")
gpu_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_bench)


def test_a_slow_set_up_still_leaves_the_timed_loop_its_share(monkeypatch):
    """Set-up (here a model build slowed to 1.5 s) longer than the run's 1 s share: the timed loop still runs."""
    real_build = gpu_bench.load_random_model

    def slow_build(*args, **kwargs):
        time.sleep(1.5)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(gpu_bench, "load_random_model", slow_build)
    monkeypatch.setattr(gpu_bench, "MIN_TIMED_S", 0.5)
    args = gpu_bench.parse_args(["--device", "cpu", "--tiny", "--runs", "torch"])
    args.ceilings = gpu_bench.measure_ceilings(torch.device("cpu"), tiny=True)
    start = time.perf_counter()
    result = gpu_bench.run_engine("torch", args, gpu_bench.RunBudget(1.0, start + 1.0))
    assert result["setup_s"] >= 1.5
    assert result["num_output_tokens_computed"] > 0 and result["steps"] > 0
    roof = result["roofline"]
    assert roof["rows"] == round(result["num_decode_tokens"] / result["steps"], 1)  # the rows steps really had
    assert roof["binding"] in ("bytes", "flops") and roof["min_step_s"] == max(roof["bytes_s"], roof["flops_s"])


def test_the_roofline_takes_the_larger_of_its_two_terms():
    """A decode step of a tiny model: bytes over bandwidth against FLOPs over the GEMM rate, by hand."""
    model = gpu_bench.build_random_model(gpu_bench.make_config(True), torch.bfloat16, torch.device("cpu"))
    s = model.shape
    weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and "embed_tokens" not in n)
    if s.tie_word_embeddings:
        weights += model.lm_head.weight.numel()
    fast_memory = gpu_bench.decode_roofline(model, 4, 100.0, {"bytes_per_s": 1e15, "bf16_flop_per_s": 1e9})
    flops = 2 * weights * 4 + 4 * 4 * 100.0 * s.num_heads * s.head_dim * s.num_layers
    assert fast_memory["binding"] == "flops" and fast_memory["step_flops"] == flops
    assert abs(fast_memory["min_step_s"] - flops / 1e9) < 1e-12
    slow_memory = gpu_bench.decode_roofline(model, 4, 100.0, {"bytes_per_s": 1e6, "bf16_flop_per_s": 1e15})
    assert slow_memory["binding"] == "bytes" and slow_memory["min_step_s"] == slow_memory["step_bytes"] / 1e6


def test_the_timed_deadline_is_its_share_from_now_capped_by_the_end(monkeypatch):
    monkeypatch.setattr(gpu_bench, "MIN_TIMED_S", 2.0)
    now = 500.0  # the bench's clock, fixed: exact deadlines whatever the machine's load
    monkeypatch.setattr(gpu_bench, "time", types.SimpleNamespace(perf_counter=lambda: now))
    assert gpu_bench.RunBudget(5.0, now + 100).timed_deadline() == now + 5.0
    assert gpu_bench.RunBudget(50.0, now + 8).timed_deadline() == now + 8  # the bench's end
    assert gpu_bench.RunBudget(1.0, now - 10).timed_deadline() == now + 2.0  # at least MIN_TIMED_S


def test_parity_judges_bf16_first():
    assert gpu_bench.PARITY_DTYPES[0] is torch.bfloat16 and torch.float32 in gpu_bench.PARITY_DTYPES


def test_steady_decode_times_full_batch_decode_steps_only():
    """Every row prefilled before the clock starts; the timed steps are all decode at the full batch."""
    args = gpu_bench.parse_args(["--device", "cpu", "--tiny", "--runs", "torch", "--steady-steps", "6",
                                 "--num-prompts", "5", "--input-len", "40", "--max-num-batched-tokens", "64"])
    args.ceilings = gpu_bench.measure_ceilings(torch.device("cpu"), tiny=True)
    result = gpu_bench.run_engine("torch", args, gpu_bench.RunBudget(60.0, time.perf_counter() + 60.0))
    assert result["mode"] == "steady" and result["steady_steps"] == 6 and result["rows"] == 5.0
    assert result["prefill_in_timed_steps"] == 0 and result["num_decode_tokens"] == 30
    assert result["prefill_steps"] >= 4  # 200 prompt tokens at 64 per step
    assert result["roofline"]["rows"] == 5.0 and result["roofline_share"] > 0


def test_the_phases_name_their_runs():
    assert gpu_bench._runs("core") == ["triton+graphs", "torch"]  # parity: gpu_check.sh's own stage
    assert gpu_bench._runs("all")[0] == "parity"
    assert gpu_bench._runs("extra")[0] == "hf" and "quant-kernels" in gpu_bench._runs("extra")
    assert "triton+graphs+fp8kv" in gpu_bench._runs("extra")  # opt-in: the extra phase only


def test_runs_parse_with_an_fp8_kv_cache():
    assert gpu_bench.parse_run("triton+graphs+fp8kv") == ("none", "triton", True, "fp8_e4m3")
    assert gpu_bench.parse_run("int8:torch") == ("int8", "torch", False, "auto")
    for bad in ("triton+fp8", "triton+graphs+graphs", "flash+graphs"):
        with pytest.raises(ValueError, match="expected"):
            gpu_bench.parse_run(bad)


def test_an_fp8_kv_run_reads_fp8_blocks_and_its_roofline_counts_them():
    args = gpu_bench.parse_args(["--device", "cpu", "--tiny", "--runs", "torch+fp8kv", "--steady-steps", "3",
                                 "--num-prompts", "3", "--input-len", "20"])
    args.ceilings = gpu_bench.measure_ceilings(torch.device("cpu"), tiny=True)
    result = gpu_bench.run_engine("torch+fp8kv", args, gpu_bench.RunBudget(60.0, time.perf_counter() + 60.0))
    assert result["runner"]["kv_cache_dtype"] == "float8_e4m3fn" and result["num_decode_tokens"] == 9
    # tiny shape: 2 layers x (K, V) x 2 kv heads x (16 codes + a 4-byte scale), against 16 x 2 bytes in bf16
    assert result["roofline"]["kv_bytes_per_token"] == 2 * 2 * 2 * (16 + 4)
    assert gpu_bench._runs("all") == ["parity"] + gpu_bench._runs("core") + gpu_bench._runs("extra")
    assert gpu_bench._runs("torch, hf") == ["torch", "hf"]


def test_the_parity_reference_keeps_its_rope_in_float32_whatever_the_dtype(monkeypatch):
    """transformers' ``.to(bf16)`` rounds rope's inv_freq (a buffer): the bf16 reference was then wrong by
    ~2 nats and the float32 pass after it matched 0 rows. With the buffers kept: float32 exact, bf16 within
    rounding, teacher-forced."""
    monkeypatch.setattr(gpu_bench, "PARITY_COMBOS", (("torch", False),))
    monkeypatch.setattr(gpu_bench, "PARITY_TOKENS", 12)
    args = gpu_bench.parse_args(["--device", "cpu", "--tiny", "--runs", "parity"])
    result = gpu_bench.run_parity(args, gpu_bench.RunBudget(120.0, time.perf_counter() + 120.0))
    assert list(result)[-2:] == ["bfloat16", "float32"]  # bf16 first
    f32, bf16 = result["float32"]["torch"], result["bfloat16"]["torch"]
    assert f32["vs_transformers"]["rows_full_match"] == 1.0 and f32["max_logprob_diff_teacher_forced"] < 1e-3
    assert bf16["max_logprob_diff_teacher_forced"] < 0.15


def test_decode_ab_runs_on_the_cpu_and_late_readback_keeps_the_tokens():
    """The extra phase's decode A/B in the CPU smoke: no kernel part; late readback (always) against off on the
    tiny model: the same tokens, steps really read late."""
    args = gpu_bench.parse_args(["--device", "cpu", "--tiny", "--runs", "decode-ab"])
    result = gpu_bench.run_decode_ab(args, gpu_bench.RunBudget(120.0, time.perf_counter() + 120.0))
    assert "kernel" not in result
    variants = result["engine"]["variants"]
    assert list(variants) == ["split=off,late=off", "split=off,late=always"]
    late = variants["split=off,late=always"]
    assert late["tokens_equal_synchronous"] is True and late["late_steps"] > 0
    assert variants["split=off,late=off"]["late_steps"] == 0 and late["step_ms"] > 0


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_the_bench_model_is_built_through_the_streamed_loader(quant):
    """The 8B-shaped model of the GPU check goes the job's way (here the tiny shape on CPU): built on meta in
    bf16, each tensor made as the random checkpoint streams in (norms 1, matrices N(0, 0.02)), quantized layer by
    layer at load; nothing left on meta, and the same tensors as the whole-model build for the same seed."""
    config = gpu_bench.make_config(True)
    model, report = gpu_bench.load_random_model(config, torch.bfloat16, torch.device("cpu"), quant, seed=3)
    tensors = list(model.parameters()) + list(model.buffers())
    assert not any(t.is_meta for t in tensors)
    assert (report is None) == (quant == "none")
    if report is not None:
        assert report.summary()["layers"]["int8"] == 9 and not report.summary()["fallbacks"]
    norms = [p for name, p in model.named_parameters() if name.endswith("norm.weight")]
    assert norms and all(bool((p == 1).all()) for p in norms)
    memory = gpu_bench.load_memory(model, torch.device("cpu"))
    assert memory["weights_mib"] > 0 and memory["cuda_max_allocated_mib"] is None
    if quant == "none":
        embed = model.embed_tokens.weight.float()
        assert embed.dtype == torch.float32 and 0.015 < embed.std().item() < 0.025
