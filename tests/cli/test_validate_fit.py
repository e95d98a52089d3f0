"""validate's fit from config.json alone (meta tensors, no weights): Llama-3-8B in bf16 fits an L4, Llama-3-70B
in int4 fits an 80 GB H100 (not in bf16); the weights' bytes counted from the real Llama-3 configs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import fsspec
import pytest
import yaml
from click.testing import CliRunner
from transformers import AutoConfig

from jobrunner.cli import main
from jobrunner.cli.validate_fit import fit_for
from jobrunner.gpus import gpu_memory_bytes

DATA = Path(__file__).resolve().parents[1] / "models" / "data"
ENGINE = SimpleNamespace(max_num_batched_tokens=2048, max_num_seqs=64, gpu_memory_utilization=0.85,
                         kv_cache_memory_bytes=None, kv_cache_dtype="auto", use_cuda_graphs="auto")
ROPE_TABLES = 8192 * 128 * 4 * 2  # cos and sin, float32, max_position_embeddings x head_dim


def _fit(name: str, quantization: str, gpu: str | None, gpus: float = 1.0):
    config = AutoConfig.from_pretrained(DATA / name)
    return fit_for(config, dtype="auto", quantization=quantization, engine=ENGINE, context=8192, gpu=gpu,
                   num_gpus_per_worker=gpus if gpu else 0)


def test_llama3_8b_bf16_fits_an_l4():
    fit = _fit("llama-3-8b", "none", "L4")
    assert fit.weights_bytes == 2 * 8_030_261_248 + ROPE_TABLES  # Llama-3-8B: 8.03 B parameters
    assert fit.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2  # layers x K,V x kv heads x head_dim x bf16
    budget = int(0.85 * 23034 * 2**20)
    assert fit.budget_bytes == budget
    assert fit.kv_bytes == budget - fit.weights_bytes - fit.activations_bytes - fit.graphs_bytes
    assert fit.fits and fit.kv_tokens > 3 * 8192
    assert fit.describe().startswith("fit on L4 (23,034 MiB) x gpu_memory_utilization 0.85: weights 16.07 GB")


def test_llama3_70b_int4_fits_an_h100_and_bf16_does_not():
    hidden, inter, kv, vocab, layers = 8192, 28672, 1024, 128256, 80
    linear = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
              (hidden, inter)]
    int4 = sum(n * k // 2 + (k // 32) * n * 4 for n, k in linear) * layers  # codes + bf16 scale, zero / 32
    int8_rows = vocab * hidden + 4 * vocab  # the head (int8 under int4) and the embedding, each
    norms = (2 * layers + 1) * hidden * 2
    fit = _fit("llama-3-70b", "int4", "H100")
    assert fit.weights_bytes == int4 + 2 * int8_rows + norms + ROPE_TABLES == 44_895_299_584
    assert fit.fits and fit.kv_tokens > 8 * 8192
    assert not _fit("llama-3-70b", "none", "H100").fits
    half = _fit("llama-3-70b", "int4", "H100", gpus=0.5)  # half a card: half the budget, the same weights
    assert half.budget_bytes == int(0.85 * 0.5 * gpu_memory_bytes("H100")) and not half.fits


def test_cpu_worker_shows_its_kv_budget():
    fit = _fit("llama-3-8b", "int8", None)
    assert fit.kv_bytes == 2 * 1024**3 and fit.describe().startswith("fit on a CPU worker (KV cache: the default")


def test_gpu_names_and_sizes():
    assert gpu_memory_bytes("l4") == 23034 * 2**20 and gpu_memory_bytes("24GB") == 24 * 10**9
    assert gpu_memory_bytes("80GiB") == 80 * 2**30
    with pytest.raises(ValueError, match="unknown GPU 'B9000': name one of T4, L4"):
        gpu_memory_bytes("B9000")


def _job(tmp_path: Path, model: str, quantization: str, **cluster) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    source = f"memory://fit-{tmp_path.name}/{model}"  # a storage URL: validate reads its config.json alone
    fsspec.filesystem("memory").pipe(f"{source}/config.json", (DATA / model / "config.json").read_bytes())
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"id": "r0", "prompt": "hello"}) + "\n")
    spec = {"name": "fit", "model": {"source": source, "quantization": quantization},
            "input": {"url": str(data), "prompt_column": "prompt", "id_column": "id"},
            "cluster": cluster, "output": {"url": str(tmp_path / "out")}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_validate_prints_the_fit_and_refuses_what_does_not_fit(tmp_path: Path):
    ok = CliRunner().invoke(main, ["validate", str(_job(tmp_path / "a", "llama-3-8b", "none", num_gpus_per_worker=1,
                                                        gpu="L4"))])
    assert ok.exit_code == 0, ok.output
    assert "fit on L4 (23,034 MiB) x gpu_memory_utilization 0.85: weights 16.07 GB" in ok.output
    assert ": fits" in ok.output
    big = CliRunner().invoke(main, ["validate", str(_job(tmp_path / "b", "llama-3-70b", "none",
                                                         num_gpus_per_worker=1, gpu="H100"))])
    assert big.exit_code != 0 and "cluster.gpu H100: the model does not fit" in big.output
    int4 = CliRunner().invoke(main, ["validate", str(_job(tmp_path / "c", "llama-3-70b", "int4",
                                                          num_gpus_per_worker=1, gpu="H100"))])
    assert int4.exit_code == 0 and "weights 44.90 GB" in int4.output and ": fits" in int4.output


def test_validate_refuses_several_gpus_per_worker_naming_tensor_parallel(tmp_path: Path):
    result = CliRunner().invoke(main, ["validate", str(_job(tmp_path, "llama-3-8b", "none", num_gpus_per_worker=2))])
    assert result.exit_code != 0
    assert "cluster.num_gpus_per_worker 2 but engine.tensor_parallel_size 1: a worker's model runs on one GPU " \
           "unless it is split; set engine.tensor_parallel_size: 2" in result.output
