"""`jobrunner bench` end to end on a tiny random Llama: JSON keys, ratio arithmetic (on hand-made runs with
exact expected values), prompt files, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from jobrunner.bench.hf_baseline import count_output_tokens, left_pad
from jobrunner.bench.runner import prefix_summary
from jobrunner.cli import main
from jobrunner.io.prompt_file import PromptFileError, read_prompts

RUN_KEYS = {"output_tokens_per_s", "total_tokens_per_s", "num_prompt_tokens", "num_cached_tokens",
            "num_output_tokens", "seconds", "ratio"}
PROMPTS = ["The quick brown fox", "Hello world!", "What is the capital of France?", "Batch inference runs"]


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def _bench(model_dir: Path, prompts: Path, *extra: str) -> dict:
    args = ["bench", "--prompts", str(prompts), "--model", str(model_dir), "--num-prompts", "4",
            "--max-tokens", "4", "--device", "cpu", "--json", *extra]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_bench_hf_baseline_json(tiny_llama_hf_dir: Path, jsonl: Path) -> None:
    data = _bench(tiny_llama_hf_dir, jsonl, "--ignore-eos", "--baseline", "hf")
    ours, base = data["ours"], data["baseline"]
    assert RUN_KEYS <= set(ours) and RUN_KEYS <= set(base)
    assert ours["num_output_tokens"] == base["num_output_tokens"] == 16  # 4 prompts x 4 tokens
    assert ours["num_prompt_tokens"] == base["num_prompt_tokens"] > 0  # identical token ids
    assert ours["ratio"] == base["ratio"] == data["ratio"] > 0  # the arithmetic: test_throughput_ratios_exact
    assert base["batch_size"] == 4 and ours["memory"]["peak_rss_mib"] > 0
    assert ours["engine_stats"]["num_decode_tokens"] > 0


def test_bench_no_baseline_parquet_messages(tiny_llama_hf_dir: Path, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"messages": messages}), path)
    data = _bench(tiny_llama_hf_dir, path, "--baseline", "none", "--compare-prefix-caching")
    assert data["baseline"] is None and data["ratio"] is None
    assert RUN_KEYS <= set(data["ours"])
    assert data["ours_no_prefix_caching"]["num_cached_tokens"] == 0
    assert 0.0 <= data["prefix_caching"]["computed_prompt_tokens_cut"] <= 1.0


def test_read_prompts_parquet_prompt_column_and_limit(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS, "other": [1, 2, 3, 4]}), path)
    assert read_prompts(path, 2) == PROMPTS[:2]


def test_missing_file_and_column_errors(tiny_llama_hf_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    missing = runner.invoke(main, ["bench", "--prompts", str(tmp_path / "nope.jsonl"), "--baseline", "none"])
    assert missing.exit_code != 0 and "not found" in missing.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "hi"}) + "\n")
    result = runner.invoke(main, ["bench", "--prompts", str(bad), "--model", str(tiny_llama_hf_dir)])
    assert result.exit_code != 0 and "no 'prompt' or 'messages'" in result.output
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["hi"]}), tmp_path / "bad.parquet")
    with pytest.raises(PromptFileError, match="no 'prompt' or 'messages' column"):
        read_prompts(tmp_path / "bad.parquet")


def test_count_output_tokens_stops_at_first_eos() -> None:
    new = torch.tensor([[5, 2, 2, 2], [5, 6, 7, 8], [2, 0, 0, 0]])
    assert count_output_tokens(new, [2], ignore_eos=False) == [2, 4, 1]
    assert count_output_tokens(new, [2], ignore_eos=True) == [4, 4, 4]


def test_left_pad() -> None:
    ids, mask = left_pad([[1, 2, 3], [4]], pad_id=9, device=torch.device("cpu"))
    assert ids.tolist() == [[1, 2, 3], [9, 9, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_prefix_summary_arithmetic() -> None:
    from jobrunner.bench.result import RunResult

    on = RunResult("on", 2.0, 4, 1000, 600, 100)
    off = RunResult("off", 4.0, 4, 1000, 0, 100)
    summary = prefix_summary(on, off)
    assert summary["computed_prompt_tokens_cut"] == pytest.approx(0.6)
    assert summary["throughput_ratio"] == pytest.approx(2.0)


def test_throughput_ratios_exact() -> None:
    from types import SimpleNamespace

    from jobrunner.bench.result import RunResult
    from jobrunner.bench.runner import _assemble

    ours = RunResult("ours", 2.0, 4, 1000, 200, 400)      # 200 output tokens/s, 700 total tokens/s
    base = RunResult("hf", 8.0, 4, 1000, 0, 400)          # 50 output tokens/s, 175 total tokens/s
    engine = SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64, model="m", quantization="none",
                             speculative="off", tensor_parallel_size=1)
    options = SimpleNamespace(engine=engine, max_tokens=4, ignore_eos=True, raw_prompts=False, prefix_caching=True,
                              compare_prefix_caching=False, baseline="hf", profile=False)
    prep = SimpleNamespace(token_ids=[[1]] * 4, num_dropped=0, model_info={"dtype": "float32"}, device="cpu",
                           attention_backend="torch")
    data = _assemble(options, prep, {"ours": ours, "baseline": base})
    assert data["ratio"] == 4.0 and data["total_tokens_ratio"] == 4.0
    assert (data["ours"]["output_tokens_per_s"], data["baseline"]["total_tokens_per_s"]) == (200.0, 175.0)
    assert data["ours"]["ratio"] == data["baseline"]["ratio"] == 4.0
    assert _assemble(options, prep, {"ours": ours})["ratio"] is None  # no baseline, no ratio


def test_bench_compare_quantization(tiny_llama_hf_dir: Path, tmp_path: Path) -> None:
    chats = [[{"role": "user", "content": p}, {"role": "assistant", "content": p + " indeed."}] for p in PROMPTS]
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    data = _bench(tiny_llama_hf_dir, prompts, "--raw-prompts", "--dtype", "float32",  # exact self-agreement
                  "--compare-quantization", "none,bfloat16:none,int8,int4",
                  "--quality-texts", str(texts), "--num-texts", "3", "--batch-sizes", "1,2")
    rows = data["quantization"]["schemes"]
    assert list(rows) == ["none", "bfloat16:none", "int8", "int4"]
    assert rows["none"]["greedy_decision_agreement"]["agreement"] == 1.0
    sizes = [rows[s]["linear_weight_bytes"] for s in ("int4", "int8", "none")]
    assert sizes == sorted(sizes) and len(set(sizes)) == 3
    assert 2 * rows["bfloat16:none"]["linear_weight_bytes"] == rows["none"]["linear_weight_bytes"]  # bf16 control
    assert all(r["perplexity"] > 1 for r in rows.values()) and set(rows["int8"]["throughput"]) == {"1", "2"}
    settings = data["quantization"]["settings"]
    assert settings["num_texts"] == 3 and (settings["prefix_caching"], settings["speculative"]) == (False, "off")


def test_comparison_engines_run_without_speculation_or_prefix_caching(tiny_llama_hf_dir: Path) -> None:
    from jobrunner.bench.quant_measure import engine_factory

    factory = engine_factory(str(tiny_llama_hf_dir), dtype="float32", device="cpu", max_num_seqs=4)
    engine = factory("bf16@int8=1")  # unquantized: the crossover is accepted and moves nothing
    assert (engine.config.speculative, engine.config.enable_prefix_caching, engine.config.max_num_seqs) == \
        ("off", False, 4)
    assert engine.model_info["dtype"] == "bfloat16" and engine.model_info.get("quant_dispatch") is None


@pytest.mark.parametrize("extra, message", [
    (("--compare-quantization", "int8,none"), "starting with none"),
    (("--compare-quantization", "bfloat16:int8,none"), "starting with none"),
    (("--compare-quantization", "none,int3"), "none|int8|int8_weight_only|int4|fp8|w8a8|bf16"),
    (("--compare-quantization", "none,float8:int8"), "dtype 'float8'"),
    (("--compare-quantization", "none,int4@int4=x"), "SCHEME=TOKENS"),
    (("--compare-quantization", "none,int8"), "--quality-texts"),
])
def test_bench_compare_quantization_bad_options(tiny_llama_hf_dir: Path, jsonl: Path, extra, message) -> None:
    args = ["bench", "--prompts", str(jsonl), "--model", str(tiny_llama_hf_dir), *extra]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and message in result.output


def test_bench_runs_the_attention_backend_it_is_given_and_says_so(tiny_llama_hf_dir: Path, jsonl: Path) -> None:
    default = _bench(tiny_llama_hf_dir, jsonl, "--ignore-eos")
    gathered = _bench(tiny_llama_hf_dir, jsonl, "--ignore-eos", "--attention-backend", "torch")
    assert default["workload"]["attention_backend"] == "cpu_paged"  # auto on CPU (CI has a compiler)
    assert gathered["workload"]["attention_backend"] == "torch"
    assert gathered["ours"]["num_output_tokens"] == default["ours"]["num_output_tokens"] == 16
    text = CliRunner().invoke(main, ["bench", "--prompts", str(jsonl), "--model", str(tiny_llama_hf_dir),
                                     "--max-tokens", "2", "--attention-backend", "cpu_paged"]).output
    assert "max_num_seqs 64, attention cpu_paged" in text
