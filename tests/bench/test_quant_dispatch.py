"""The dispatch benchmark's in-process measurement (tiny model), its table with the targets, the configs it
loads side by side (dtype, per-layer overrides, crossovers) and the environment of each capability's process."""

from __future__ import annotations

import os

import pytest

from jobrunner.bench.quant_configs import QuantConfig, parse_config, parse_configs
from jobrunner.bench.quant_dispatch import AVX2_ENV, capability_env, measure_here, render
from jobrunner.quant.dispatch import CAPABILITY_ENV, CROSSOVER_ENV

TEXTS = ["hello there, general kenobi", "the quick brown fox jumps over the lazy dog"]


def test_measure_here_on_a_tiny_model_with_avx2_forced(tiny_llama_hf_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CAPABILITY_ENV, "avx2")
    result = measure_here(str(tiny_llama_hf_dir), ["none", "int8", "int4"], [1, 2], max_tokens=2,
                          prompts=["hello there", "the quick brown fox"], rounds=1)
    assert set(result["tok_s"]) == {"none", "int8", "int4"}
    assert all(set(row) == {"1", "2"} and min(row.values()) > 0 for row in result["tok_s"].values())
    assert result["profile"]["capability"] == "avx2" and result["dispatch"]["none"] is None
    assert result["dispatch"]["int4"]["dequant_dtype"] == "float32"
    assert result["dtype"] == {"none": "float32", "int8": "float32", "int4": "float32"}


def test_measure_here_loads_dtypes_and_crossovers_per_config_and_scores_each(
        tiny_llama_hf_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CAPABILITY_ENV, "avx2")
    monkeypatch.delenv(CROSSOVER_ENV, raising=False)
    configs = ["float32:none", "bf16", "int4", "int4@int4=1", "bfloat16:int8/lm_head=int4"]
    texts = [*TEXTS, "a text longer than the tiny model's 256 positions " * 30]  # scored on its first 256
    result = measure_here(str(tiny_llama_hf_dir), configs, [1], max_tokens=2, prompts=["hello there"], rounds=1,
                          dtype="float32", texts=texts)
    assert result["dtype"] == {"float32:none": "float32", "bf16": "bfloat16", "int4": "float32",
                               "int4@int4=1": "float32", "bfloat16:int8/lm_head=int4": "bfloat16"}
    kernel_tokens = {name: d and d["max_kernel_tokens"] for name, d in result["dispatch"].items()}
    assert kernel_tokens["int4"] == {"int8": 256, "int4": 256}  # avx2's own crossovers
    assert kernel_tokens["int4@int4=1"] == {"int8": 256, "int4": 1}  # this engine's, while it loaded
    assert os.environ.get(CROSSOVER_ENV) is None  # and only then
    quality = result["quality"]
    assert list(quality) == configs and quality["float32:none"]["teacher_forced_top1_agreement"] == 1.0
    # the same int4 weights through another kernel (dequantized float32 tiles instead of the packed kernel)
    assert quality["int4@int4=1"]["perplexity"] == pytest.approx(quality["int4"]["perplexity"], rel=1e-3)
    assert {q["num_tokens"] for q in quality.values()} == {_num_scored_tokens(tiny_llama_hf_dir, texts)}
    assert all(q["perplexity"] > 1 for q in quality.values())


def test_render_marks_the_targets() -> None:
    dispatch = {"max_kernel_tokens": {"int8": 4, "int4": 16}, "dequant_dtype": "float32", "fp8_native": False}
    result = {"profile": {"capability": "avx2", "forced": True, "fast_bf16": False, "calibration": None},
              "threads": 2, "dtype": {"none": "float32", "int8": "float32", "int4": "float32"},
              "dispatch": {"none": None, "int8": dispatch, "int4": dispatch},
              "tok_s": {"none": {"1": 20.0, "64": 100.0}, "int8": {"1": 30.0, "64": 90.0},
                        "int4": {"1": 19.0, "64": 80.0}}}
    table = render("avx2", result)
    assert "| config | tok/s b1 | tok/s b64 | vs best float b1 | vs best float b64 | targets |" in table
    assert "| none | 20.0 | 100.0 | 1.00x | 1.00x | float |" in table
    assert "| int8 | 30.0 | 90.0 | 1.50x | 0.90x | b1 ok, b64 ok |" in table
    assert "| int4 | 19.0 | 80.0 | 0.95x | 0.80x | b1 MISSED, b64 MISSED |" in table
    assert "* int4 (model float32): weight-only kernel up to 16 tokens, then dequantized tiles in float32" in table


def test_render_compares_with_the_best_float_config_per_batch_size_and_shows_quality() -> None:
    result = {"profile": {"capability": "avx512_bf16", "forced": False, "fast_bf16": True, "calibration": None},
              "threads": 2, "dtype": {}, "dispatch": {},
              "tok_s": {"float32:none": {"1": 10.0, "64": 100.0}, "bfloat16:none": {"1": 20.0, "64": 80.0},
                        "bfloat16:w8a8": {"1": 30.0, "64": 80.0}},
              "quality": {"float32:none": {"perplexity": 10.0, "teacher_forced_top1_agreement": 1.0},
                          "bfloat16:none": {"perplexity": 10.1, "teacher_forced_top1_agreement": 0.98},
                          "bfloat16:w8a8": {"perplexity": 10.5, "teacher_forced_top1_agreement": 0.9}}}
    lines = render("native", result).splitlines()
    assert lines[1].endswith("| targets | perplexity | Δppl | top-1 |") and lines[2] == "|---" * 9 + "|"
    assert lines[3:] == [
        "| float32:none | 10.0 | 100.0 | 0.50x | 1.00x | float | 10.0000 | +0.00% | 100.0% |",
        "| bfloat16:none | 20.0 | 80.0 | 1.00x | 0.80x | float | 10.1000 | +1.00% | 98.0% |",
        "| bfloat16:w8a8 | 30.0 | 80.0 | 1.50x | 0.80x | b1 ok, b64 MISSED | 10.5000 | +5.00% | 90.0% |"]


def test_parse_config_reads_dtype_scheme_overrides_and_crossovers() -> None:
    assert parse_config("int4", "float32") == QuantConfig("int4", "float32", "int4")
    assert parse_config("bf16", "float32") == QuantConfig("bf16", "bfloat16", "none")
    assert parse_config("BFloat16:int4/lm_head=int8+*.down_proj=none@int4=8+int4_int8=4096") == QuantConfig(
        "bfloat16:int4/lm_head=int8+*.down_proj=none@int4=8+int4_int8=4096", "bfloat16", "int4",
        (("lm_head", "int8"), ("*.down_proj", "none")), "int4=8,int4_int8=4096")
    assert [c.is_quantized for c in parse_configs(["float32:none", "bf16", "w8a8"])] == [False, False, True]


@pytest.mark.parametrize("names, message", [
    (["int8", "none"], "starting with none"),
    (["none", "float8:int8"], "dtype 'float8'"),
    (["none", "int3"], "unknown scheme"),
    (["none", "int4/lm_head=int3"], "unknown scheme"),
    (["none", "int4@int4"], "NAME=VALUE"),
    (["none", "int4@int4=many"], "SCHEME=TOKENS"),
    (["none", "int4", "int4"], "named twice"),
])
def test_parse_configs_refuses(names: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_configs(names)


def test_each_capability_gets_its_own_environment() -> None:
    parent = {"PATH": "/bin", **AVX2_ENV}  # a parent that was itself started with AVX2 forced
    assert capability_env("native", parent) == {"PATH": "/bin"}
    assert capability_env("avx2", {"PATH": "/bin"}) == {"PATH": "/bin", **AVX2_ENV}
    assert capability_env("avx512_vnni", parent) == {"PATH": "/bin", CAPABILITY_ENV: "avx512_vnni"}


def test_bench_cli_runs_the_dispatch_check_per_capability_in_a_fresh_process(tiny_llama_hf_dir, tmp_path) -> None:
    import json

    from click.testing import CliRunner

    from jobrunner.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n{"prompt": "the quick brown fox"}\n')
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in [*TEXTS, "not read: past --num-texts"]))
    args = ["bench", "--model", str(tiny_llama_hf_dir), "--prompts", str(prompts), "--max-tokens", "2",
            "--raw-prompts", "--batch-sizes", "1,2", "--quality-texts", str(texts), "--num-texts", "2",
            "--compare-quantization", "float32:none,bf16,float32:int8", "--quant-dispatch", "avx2", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "## avx2: capability avx2 (forced True)" in result.output
    measured = json.loads(result.output.strip().splitlines()[-1])["quant_dispatch"]["avx2"]
    assert list(measured["tok_s"]) == ["float32:none", "bf16", "float32:int8"]
    assert measured["profile"]["forced"] is True
    assert measured["dtype"] == {"float32:none": "float32", "bf16": "bfloat16", "float32:int8": "float32"}
    assert measured["quality"]["float32:none"]["teacher_forced_top1_agreement"] == 1.0
    scored = measured["quality"]["bf16"]["num_tokens"]
    assert "| float32:none |" in result.output and "| perplexity | Δppl | top-1 |" in result.output
    base = [a for a in args if a not in ("--json",)]
    refused = CliRunner().invoke(main, [*base[:-2], "--quant-dispatch", "avx3"])
    assert refused.exit_code == 2 and "native|default|avx2|avx512|avx512_vnni|avx512_bf16|amx" in refused.output
    refused = CliRunner().invoke(main, [*base[:-4], "--compare-quantization", "int8,none", "--quant-dispatch",
                                        "avx2"])
    assert refused.exit_code == 2 and "starting with none" in refused.output
    assert scored == _num_scored_tokens(tiny_llama_hf_dir, TEXTS)


def _num_scored_tokens(model_dir, texts: list[str], max_positions: int = 256) -> int:
    """Tokens that predict a next one: each text's token count (at most the tiny model's positions) less one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return sum(min(len(tokenizer(t, add_special_tokens=False)["input_ids"]), max_positions) - 1 for t in texts)


def test_bench_cli_times_one_layer_per_path() -> None:
    from click.testing import CliRunner

    from jobrunner.cli import main

    result = CliRunner().invoke(main, ["bench", "--quant-kernels", "--batch-sizes", "1"])
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert lines[0].startswith("torch ") and "microseconds, best of 7" in lines[0]
    assert [line.split()[0] for line in lines[1:]] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"]
    assert all("tokens=  1 float=" in line and "int4_layer=" in line for line in lines[1:])


def test_per_layer_overrides_are_applied_where_bf16_weights_are_packed(tiny_llama_hf_dir, monkeypatch) -> None:
    """``int8/lm_head=none`` on a CPU that packs bf16 linears (forced avx512_bf16): every other linear int8, the
    head kept bf16 and packed (a packed linear was once skipped by quantize_model: the config ran unquantized)."""
    from jobrunner.bench.quant_configs import load_engine
    from jobrunner.engine import EngineConfig
    from jobrunner.models.onednn_linear import OneDnnLinear

    monkeypatch.setenv("JOBRUNNER_CPU_CAPABILITY", "avx512_bf16")
    config = parse_config("bfloat16:int8/lm_head=none")
    engine = load_engine(str(tiny_llama_hf_dir), config, EngineConfig(num_kv_blocks=16, device="cpu"))
    report = engine.model_info["quantization_report"]
    assert report["layers"] == {"int8": 8, "none": 1}
    assert isinstance(engine.model.lm_head, OneDnnLinear)  # the bf16 head packed after quantizing
