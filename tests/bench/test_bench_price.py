"""`jobrunner bench --worker-hour-usd`: $ / M tokens of the workload at steady state, and a warning when the
machine's load makes the numbers mean little."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from jobrunner.bench.price import bench_price, load_warning, machine_load, price_line
from jobrunner.cli import main


def test_price_of_a_run_exact() -> None:
    # 10 s at $3.60 / h = $0.01; prefill 1 s of 4 s engine time: a quarter of the bill is input
    run = {"seconds": 10.0, "num_prompt_tokens": 2500, "num_output_tokens": 7500,
           "engine_stats": {"prefill_s": 1.0, "decode_s": 3.0}}
    price = bench_price(run, 3.6)
    assert price["total_usd"] == pytest.approx(0.01)
    assert price["usd_per_m_input"] == pytest.approx(0.0025 / 2500 * 1e6)  # $1.00
    assert price["usd_per_m_output"] == pytest.approx(0.0075 / 7500 * 1e6)  # $1.00
    assert price["usd_per_m_total"] == pytest.approx(1.0)
    assert price_line(price) == ("steady state at $3.6 / worker-hour (one worker, start-up excluded): $ / M input 1, "
                                 "output 1, total 1")


def test_load_warning_names_the_load() -> None:
    idle = {"load_1m": 0.3, "cpus": 8, "others_load": 0.3, "others_share": 0.04}
    busy = {"load_1m": 3.6, "cpus": 2, "others_load": 3.6, "others_share": 1.8}
    assert load_warning(idle, idle) is None
    warning = load_warning(idle, busy)
    assert warning is not None and "(1-minute load 3.6 on 2 CPUs: other processes keep about 3.6 CPUs' worth busy)" \
        in warning


def test_own_threads_are_not_other_processes() -> None:
    mine = machine_load(own_threads=10_000)
    assert mine["others_share"] in (0.0, None) and mine["cpus"] >= 1


def test_bench_prints_the_price_and_the_load(tiny_llama_hf_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Hello world", "The quick brown fox")))
    result = CliRunner().invoke(main, ["bench", "--prompts", str(prompts), "--model", str(tiny_llama_hf_dir),
                                       "--max-tokens", "4", "--ignore-eos", "--device", "cpu",
                                       "--worker-hour-usd", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    ours, price = data["ours"], data["price"]
    assert price["worker_hour_usd"] == 2.0
    tokens = ours["num_prompt_tokens"] + ours["num_output_tokens"]
    assert price["usd_per_m_total"] == pytest.approx(ours["seconds"] * 2.0 / 3600 / tokens * 1e6)
    assert "steady state at $2 / worker-hour" in result.stdout
    load = data["machine_load"]
    assert set(load) == {"before", "after", "warning"} and load["before"]["cpus"] >= 1
    assert load["warning"] is None or load["warning"] in result.output  # on stderr, busy or not by this machine
