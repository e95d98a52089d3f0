"""validate on a tensor-parallel spec from config.json alone: jobs/llama70b-tp8.yaml (Llama-3.3-70B-Instruct on
8 H100s) through our engine and through vLLM, its real config.json read offline from a Hugging Face cache layout
under tests/data/hf_hub (nothing downloaded, no weights); numbers that do not divide named as errors (ours) or
warnings (vLLM); a rank's share that does not fit its GPU refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from jobrunner.cli import main
from jobrunner.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
JOB = str(REPO / "jobs" / "llama70b-tp8.yaml")
HUB = REPO / "tests" / "data" / "hf_hub"
# Llama-3.3-70B over 8 ranks in bfloat16: per layer q|k|v (8 + 2 x 1 heads of 128) and o of 8 heads, gate|up
# and down of 3,584; the norms whole; 16,032 rows each of the embedding and the head; the final norm
HIDDEN, LAYERS = 8192, 80
PER_LAYER = (8 * 128 + 2 * 128) * HIDDEN + HIDDEN * 8 * 128 + 3 * 3584 * HIDDEN + 2 * HIDDEN
RANK_WEIGHTS = 2 * (LAYERS * PER_LAYER + 2 * 16032 * HIDDEN + HIDDEN)
SPLIT = ("tensor parallel 8: per rank 8 of 64 q heads, 1 of 8 KV heads, intermediate 3,584 of 28,672, vocabulary "
         "16,032 of 128,256 rows; replicated on every rank: norms, rotary")


@pytest.fixture
def offline_hub(monkeypatch):
    """The committed config.json as the local Hugging Face cache, with the Hub switched off."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(HUB))
    monkeypatch.chdir(REPO)  # the spec names its input relative to the checkout


def _validate(*overrides: str):
    args = ["validate", JOB]
    for item in overrides:
        args += ["--set", item]
    return CliRunner().invoke(main, args)


def test_the_70b_spec_through_our_engine(offline_hub, tmp_path):
    result = _validate(f"output.url={tmp_path / 'out'}")
    assert result.exit_code == 0, result.output
    assert "LlamaForCausalLM, 70,553.7 M parameters (weights: 141.11 GB as bfloat16)" in result.output
    assert SPLIT in result.output
    assert RANK_WEIGHTS == 17_640_734_720
    assert ("each of 8 GPUs (H100, 81,559 MiB x gpu_memory_utilization 0.85): weights 17.64 GB (2.6 MB of it "
            "replicated; the whole model 141.11 GB)") in result.output
    assert "sequences of 16,384): fits" in result.output


@pytest.mark.heavy  # vLLM's own import (~15 s); its split and fit lines are checked below without it
def test_the_70b_spec_through_vllm(offline_hub, tmp_path):
    from tests.vllm_backend.vllm_python import vllm_python_or_skip

    python = vllm_python_or_skip()
    result = _validate(f"output.url={tmp_path / 'out'}", "engine.backend=vllm", f"engine.vllm_python={python}")
    assert result.exit_code == 0, result.output
    assert "engine: vLLM 0.32.0 at" in result.output and SPLIT in result.output
    assert "weights 17.64 GB" in result.output and "fits (our estimate: vLLM measures its own)" in result.output


def test_heads_that_do_not_divide_are_named(offline_hub, tmp_path):
    result = _validate(f"output.url={tmp_path / 'out'}", "engine.tensor_parallel_size=3",
                       "cluster.num_gpus_per_worker=3")
    assert result.exit_code != 0
    assert ("engine.tensor_parallel_size 3: the model does not split: num_attention_heads 64 is not divisible by "
            "tensor_parallel_size 3; num_key_value_heads 8 is not divisible by tensor_parallel_size 3; "
            "intermediate_size 28672 is not divisible by tensor_parallel_size 3") in result.output


def test_vllm_gets_a_warning_for_them(offline_hub, tmp_path):
    from jobrunner.cli.validate_parallel import vllm_section

    spec = load_spec(JOB, [f"output.url={tmp_path / 'out'}", "engine.backend=vllm", "engine.tensor_parallel_size=3",
                           "cluster.num_gpus_per_worker=3"])
    lines = vllm_section(spec)
    assert "warning: engine.tensor_parallel_size 3: the model does not split: num_attention_heads 64" in lines
    assert "(our engine's rules; vLLM checks its own when it loads the model)" in lines


def test_more_ranks_than_kv_heads_replicate_them(offline_hub, tmp_path):
    result = _validate(f"output.url={tmp_path / 'out'}", "engine.tensor_parallel_size=16",
                       "cluster.num_gpus_per_worker=16")
    assert result.exit_code == 0, result.output
    assert "per rank 4 of 64 q heads, KV heads replicated: each of the 8 KV heads on 2 ranks, 1 per rank" \
        in result.output


def test_a_share_too_big_for_its_gpu_is_refused(offline_hub, tmp_path):
    result = _validate(f"output.url={tmp_path / 'out'}", "engine.tensor_parallel_size=2",
                       "cluster.num_gpus_per_worker=2", "cluster.gpu=L4")
    assert result.exit_code != 0
    assert "cluster.gpu L4: a rank's share does not fit: each of 2 GPUs (L4, 23,034 MiB" in result.output
    assert "weights 70.56 GB" in result.output and "does NOT fit" in result.output


def test_vllm_pipeline_stages_divide_the_layers(offline_hub, tmp_path):
    from jobrunner.cli.validate_parallel import vllm_section

    spec = load_spec(JOB, [f"output.url={tmp_path / 'out'}", "engine.backend=vllm", "engine.tensor_parallel_size=4",
                           "engine.pipeline_parallel_size=2"])
    lines = vllm_section(spec)
    assert "tensor parallel 4: per rank 16 of 64 q heads, 2 of 8 KV heads" in lines
    assert "pipeline parallel 2: the layers split over 2 stages (vLLM), 8 GPUs per worker" in lines
    assert "each of 8 GPUs (H100" in lines and "1/2 of the layers" in lines


def test_cpu_ranks_and_unnamed_gpus_show_the_weights_per_rank(offline_hub, tmp_path):
    from jobrunner.cli.validate_parallel import parallel_section
    from jobrunner.models.preflight import read_config

    config, _ = read_config("meta-llama/Llama-3.3-70B-Instruct")
    cpu = load_spec(JOB, [f"output.url={tmp_path / 'out'}", "cluster.num_gpus_per_worker=0",
                          "cluster.num_cpus_per_worker=8"])
    lines = parallel_section(cpu, config, 16384, "none")
    assert SPLIT in lines
    assert "weights per rank 17.64 GB (2.6 MB of it replicated; the whole model 141.11 GB)" in lines
    unnamed = load_spec(JOB, [f"output.url={tmp_path / 'out'}", "cluster.gpu=null"])
    assert "; bytes per GPU not checked (set cluster.gpu, e.g. H100)" in parallel_section(unnamed, config, 16384,
                                                                                          "none")


def test_a_padded_vocabulary_says_so(offline_hub):
    import copy

    from jobrunner.cli.validate_parallel import split_line
    from jobrunner.models.preflight import read_config

    config, _ = read_config("meta-llama/Llama-3.3-70B-Instruct")
    odd = copy.deepcopy(config)
    odd.vocab_size = 128_257  # not a multiple of 8: each rank holds 16,033 rows, the last padded
    assert "vocabulary 16,033 of 128,257 rows (padded to 128,264); replicated" in split_line(odd, 8)


@pytest.fixture
def no_network(monkeypatch):
    """The Hub's host does not resolve (a machine without network), HF_HUB_OFFLINE unset."""
    from jobrunner.models import preflight

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(preflight, "_resolves", lambda host: False)
    monkeypatch.chdir(REPO)


OFFLINE_HOW = ("to check it offline, set HF_HUB_OFFLINE=1 with a Hugging Face cache (HF_HUB_CACHE) that holds the "
               "model's config.json, or name a local directory with its config.json in model.source")


def test_without_network_validate_says_the_split_was_not_checked_and_how_to(no_network, tmp_path):
    result = _validate(f"output.url={tmp_path / 'out'}")
    assert result.exit_code == 0, result.output
    assert ("(config not checked: the Hugging Face Hub (huggingface.co) cannot be reached from here; each worker "
            "downloads and checks it)\n  tensor parallel 8: the split of the model and the bytes per GPU not "
            f"checked; {OFFLINE_HOW}") in result.output
    one_rank = _validate(f"output.url={tmp_path / 'out'}", "engine.tensor_parallel_size=1",
                         "cluster.num_gpus_per_worker=1")
    assert one_rank.exit_code == 0, one_rank.output
    assert "config not checked" in one_rank.output and "split of the model" not in one_rank.output


def test_without_network_the_vllm_lines_say_how_to_check_offline(no_network, tmp_path):
    from jobrunner.cli.validate_parallel import vllm_section

    spec = load_spec(JOB, [f"output.url={tmp_path / 'out'}", "engine.backend=vllm"])
    assert vllm_section(spec) == ("\n  tensor / pipeline split not checked: the Hugging Face Hub (huggingface.co) "
                                  f"cannot be reached from here; {OFFLINE_HOW}")
