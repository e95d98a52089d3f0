"""`jobrunner bench --profile` and the engine's StepProfiler on a tiny random Llama: every part present, shares
that add up, exact step and token counts, nothing left installed afterwards, tokens unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from jobrunner.cli import main
from jobrunner.engine import EngineConfig, SamplingParams
from jobrunner.engine.profile import CATEGORIES, HOST_PARTS, StepProfiler, _Clock

PROMPTS = ["The quick brown fox", "Hello world!", "What is the capital of France?", "Batch inference runs"]


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def test_bench_profile_json_and_table(tiny_llama_hf_dir: Path, jsonl: Path) -> None:
    args = ["bench", "--prompts", str(jsonl), "--model", str(tiny_llama_hf_dir), "--num-prompts", "4",
            "--max-tokens", "4", "--ignore-eos", "--device", "cpu", "--dtype", "float32", "--profile", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    ours, prof = data["ours"], data["ours"]["profile"]
    stats = ours["engine_stats"]
    # 4 prompts fit one step (prefill + first token each), then 3 decode-only steps of 4 rows
    assert prof["num_steps"] == stats["steps"] == 4
    assert prof["by_step_kind"]["decode"]["num_steps"] == 3 and prof["by_step_kind"]["prefill"]["num_steps"] == 1
    assert prof["by_step_kind"]["decode"]["num_tokens"] == 12 == stats["num_decode_tokens"]
    assert prof["by_step_kind"]["prefill"]["num_tokens"] == ours["num_prompt_tokens"]
    assert set(prof["parts"]) == set(CATEGORIES) and set(prof["host_parts"]) == set(HOST_PARTS)
    assert all(part["seconds"] > 0 for part in prof["parts"].values())
    assert sum(p["share"] for p in prof["parts"].values()) == pytest.approx(1.0, abs=1e-9)
    host = sum(p["seconds"] for p in prof["host_parts"].values())
    assert host == pytest.approx(prof["parts"]["host"]["seconds"], abs=1e-5)
    assert 0 < prof["share_of_run"] <= 1.0
    assert [s["num_decode_tokens"] for s in prof["steps"]] == [0, 4, 4, 4]
    assert data["workload"]["profile"] is True
    text = result.stdout
    assert "ours profile: 4 steps (3 decode-only, 1 with prompt tokens)" in text
    for name in (*CATEGORIES, "  schedule", "  inputs", "  outputs", "  rest"):
        assert f"\n{name} " in text


def test_profiler_detaches_and_keeps_tokens(tiny_llama_hf_dir: Path) -> None:
    from jobrunner.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_source(str(tiny_llama_hf_dir), "float32", config=EngineConfig(device="cpu"))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plain = [o.output_token_ids for o in engine.generate([[5, 6, 7, 8], [9, 10]], params)]
    with StepProfiler(engine) as profiler:
        profiled = [o.output_token_ids for o in engine.generate([[5, 6, 7, 8], [9, 10]], params)]
    assert profiled == plain
    assert profiler.summary()["num_steps"] == 6
    modules = list(engine.model.modules())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in modules)
    assert not any("attend" in vars(m) for m in modules)
    for obj, name in ((engine, "step"), (engine.scheduler, "update_from_output"), (engine.scheduler, "schedule"),
                      (engine.runner, "_layout"), (engine.runner.steps, "run"),
                      (engine.runner.sampler, "sample_on_device")):
        assert name not in vars(obj), name


def test_clock_charges_exclusive_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    ticks = iter([0.0, 1.0, 3.0, 6.0, 10.0, 15.0])
    monkeypatch.setattr("jobrunner.engine.profile.time.perf_counter", lambda: next(ticks))
    clock = _Clock(torch.device("cpu"))
    clock.enter("host")        # 0
    clock.enter("gemm")        # 1: host 1
    clock.enter("attention")   # 3: gemm 2
    clock.exit()               # 6: attention 3
    clock.exit()               # 10: gemm 2 + 4
    clock.exit()               # 15: host 1 + 5
    assert dict(clock.seconds) == {"host": 6.0, "gemm": 6.0, "attention": 3.0} and not clock.stack
