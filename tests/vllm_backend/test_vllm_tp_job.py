"""A job through engine.backend vllm at engine.tensor_parallel_size 2 on CPU (real vLLM, Ray, one core per rank):
every row once, the greedy texts equal to the same job at tensor_parallel_size 1, the ranks and their cores in the
manifest. The model: a random Llama with heads vLLM can split in two and a head size its CPU attention takes
(SmolLM2-135M's 9 heads do not divide by 2: vLLM refuses it, as `jobrunner validate` does)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobrunner.driver.job import run_job
from jobrunner.io.parts import read_output
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import read_manifest_file
from tests.vllm_backend.vllm_python import vllm_python_or_skip

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(900)]
PROMPTS = ["The quick brown fox", "Batch inference runs many prompts", "Hello world! 0123456789",
           "What is the capital of France?", "a block holds sixteen tokens", "jumps over the lazy dog",
           "Paris.", "many prompts together"]


@pytest.fixture(scope="module")
def tp_llama_dir(tmp_path_factory):
    """A seeded random 2-layer Llama: hidden 256, 4 q heads and 2 KV heads of 64 (vLLM's CPU attention takes head
    sizes from 32 up), with the suite's tiny byte-level tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import make_tiny_tokenizer

    out = tmp_path_factory.mktemp("tp_llama")
    tokenizer = make_tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def _run(tmp_path, model_dir, python, tp: int, name: str):
    data = tmp_path / "in.parquet"
    if not data.exists():
        pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(PROMPTS))], "prompt": PROMPTS}), data)
    spec = spec_from_dict({
        "name": name, "model": {"source": str(model_dir), "dtype": "float32"},
        "input": {"url": str(data), "prompt_column": "prompt", "id_column": "id", "rows_per_shard": 4},
        "sampling": {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True},
        "engine": {"backend": "vllm", "vllm_python": python, "tensor_parallel_size": tp, "max_model_len": 512,
                   "kv_cache_memory_bytes": 2**30},
        "cluster": {"num_workers": 1, "num_cpus_per_worker": 2}, "output": {"url": str(tmp_path / name)}})
    result = run_job(spec, show_progress=False)
    assert result.ok, result.summary()
    return read_output(str(tmp_path / name)).to_pylist(), read_manifest_file(tmp_path / name)


def test_tensor_parallel_2_rows_once_and_equal_to_one_rank(local_ray, tmp_path, tp_llama_dir):
    python = vllm_python_or_skip()
    one, _ = _run(tmp_path, tp_llama_dir, python, 1, "tp1")
    two, manifest = _run(tmp_path, tp_llama_dir, python, 2, "tp2")
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    assert sorted(r["id"] for r in two) == ids  # every row once
    assert all(r["error"] is None and r["num_output_tokens"] == 12 for r in two)
    texts = {r["id"]: r["generated_text"] for r in one}
    assert {r["id"]: r["generated_text"] for r in two} == texts  # greedy: the same tokens over two ranks
    model = manifest["model"]
    assert model["backend"] == "vllm" and model["tensor_parallel_size"] == 2 and model["vllm_executor"] == "mp"
    assert len(model["vllm_cpu_bind"].split("|")) == 2  # one core each


def test_bench_runs_both_engines_at_tensor_parallel_2(tmp_path, tp_llama_dir):
    """`jobrunner bench --engine jobrunner,vllm --tensor-parallel-size 2`: ours over two local ranks, vLLM over two
    processes bound to one core each, on the same token ids."""
    import json

    from click.testing import CliRunner

    from jobrunner.cli import main

    python = vllm_python_or_skip()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:4]))
    args = ["bench", "--model", str(tp_llama_dir), "--prompts", str(prompts), "--num-prompts", "4", "--max-tokens",
            "8", "--ignore-eos", "--raw-prompts", "--dtype", "float32", "--speculative", "off", "--engine",
            "jobrunner,vllm", "--vllm-python", python, "--vllm-eager", "--tensor-parallel-size", "2", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    ours, theirs = out["ours"], out["baseline"]
    assert ours["num_prompt_tokens"] == theirs["num_prompt_tokens"] > 0
    assert ours["num_output_tokens"] == theirs["num_output_tokens"] == 32 and theirs["num_errors"] == 0


def _descendants(pid: int) -> list[int]:
    import subprocess

    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    kids = [int(x) for x in out]
    return kids + [g for k in kids for g in _descendants(k)]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_killed_vllm_process_takes_its_ranks_with_it(tmp_path, tp_llama_dir):
    """A worker's vLLM process killed (-9) with two CPU ranks: vLLM's rank processes end too (none is left to hold
    its cores and memory while the worker starts a new engine)."""
    import os
    import signal
    import time

    from jobrunner.vllm_backend.build import build_vllm_engine

    python = vllm_python_or_skip()
    spec = spec_from_dict({
        "name": "kill", "model": {"source": str(tp_llama_dir), "dtype": "float32"},
        "input": {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt"},
        "engine": {"backend": "vllm", "vllm_python": python, "tensor_parallel_size": 2, "max_model_len": 256,
                   "kv_cache_memory_bytes": 2**30},
        "cluster": {"num_cpus_per_worker": 2}, "output": {"url": str(tmp_path / "out")}})
    engine = build_vllm_engine(spec)
    ranks = _descendants(engine._proc.pid)
    assert len(ranks) >= 2 and engine.model_info["tensor_parallel_size"] == 2
    os.kill(engine._proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while any(_running(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [p for p in ranks if _running(p)] == []
