"""scripts/gpu_bench.py's budget rules, on CPU (the tool that a lent GPU runs first: a mistake found there costs
device minutes): a run's timed loop gets its share after its set-up, and parity runs the judged dtype first."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPTS / "gpu_bench.py")
gpu_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_bench)


def test_a_slow_set_up_still_leaves_the_timed_loop_its_share(monkeypatch):
    """Set-up (here a model build slowed to 1.5 s) longer than the run's 1 s share: the timed loop still runs."""
    real_build = gpu_bench.build_random_model

    def slow_build(*args, **kwargs):
        time.sleep(1.5)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(gpu_bench, "build_random_model", slow_build)
    monkeypatch.setattr(gpu_bench, "MIN_TIMED_S", 0.5)
    args = gpu_bench.parse_args(["--device", "cpu", "--tiny", "--runs", "torch"])
    start = time.perf_counter()
    result = gpu_bench.run_engine("torch", args, gpu_bench.RunBudget(1.0, start + 1.0))
    assert result["setup_s"] >= 1.5
    assert result["num_output_tokens_computed"] > 0 and result["steps"] > 0


def test_the_timed_deadline_is_its_share_from_now_capped_by_the_end(monkeypatch):
    monkeypatch.setattr(gpu_bench, "MIN_TIMED_S", 2.0)
    now = time.perf_counter()
    assert abs(gpu_bench.RunBudget(5.0, now + 100).timed_deadline() - (now + 5.0)) < 0.5
    assert abs(gpu_bench.RunBudget(50.0, now + 8).timed_deadline() - (now + 8)) < 0.5   # the bench's end
    assert abs(gpu_bench.RunBudget(1.0, now - 10).timed_deadline() - (now + 2.0)) < 0.5  # at least MIN_TIMED_S


def test_parity_judges_bf16_first():
    assert gpu_bench.PARITY_DTYPES[0] is torch.bfloat16 and torch.float32 in gpu_bench.PARITY_DTYPES
