"""The model checked from its config.json alone (validate / run), before any weight is downloaded."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import fsspec
import pytest
from click.testing import CliRunner

from jobrunner.cli import main
from jobrunner.models.preflight import preflight
from jobrunner.models.sources import ModelSourceError

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=384, hidden_size=64,
             intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, tie_word_embeddings=False)


def _config_dir(tmp_path: Path, **changes) -> Path:
    """A directory holding only config.json: enough for the check, nothing a worker could load."""
    folder = tmp_path / f"model-{uuid.uuid4().hex[:6]}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA, **changes}))
    return folder


def test_a_supported_config_reports_architecture_size_and_context(tmp_path):
    check = preflight(str(_config_dir(tmp_path)))
    # embed 384x64 + head 384x64 + 2 layers x (qkv 64x128 + o 64x64 + gate_up 64x256 + down 128x64 + 2 norms 64)
    # + final norm 64, counted from the config alone
    expected = 2 * 384 * 64 + 2 * (64 * 128 + 64 * 64 + 64 * 256 + 128 * 64 + 2 * 64) + 64
    assert (check.architecture, check.num_params, check.context) == ("LlamaForCausalLM", expected, 512)
    assert preflight(str(_config_dir(tmp_path)), max_model_len=256).context == 256
    line = check.describe("auto", "none")
    assert line.startswith("LlamaForCausalLM, 0.1 M parameters (weights: 0.00 GB as bfloat16 or 0.00 GB as float32)")


def test_an_unsupported_architecture_is_refused_naming_the_supported_ones(tmp_path):
    folder = _config_dir(tmp_path, model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=64, n_layer=2,
                         n_head=4)
    with pytest.raises(ModelSourceError, match=r"unsupported model architecture 'GPT2LMHeadModel'; supported: "
                                               r"LlamaForCausalLM, .*Qwen3ForCausalLM"):
        preflight(str(folder))


def test_a_rope_scaling_the_engine_cannot_follow_is_refused_before_any_download(tmp_path):
    folder = _config_dir(tmp_path, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ModelSourceError, match=r"config.json: unsupported rope scaling rope_type='dynamic'"):
        preflight(str(folder))


def test_a_context_beyond_the_models_limit_is_refused(tmp_path):
    with pytest.raises(ModelSourceError, match=r"engine.max_model_len=1024 is longer than the model's "
                                               r"max_position_embeddings=512 .*set it to 512 or less"):
        preflight(str(_config_dir(tmp_path)), max_model_len=1024)


def test_a_storage_url_is_checked_from_its_config_object_alone(tmp_path, s3_server):
    options = s3_server["storage_options"]
    fs = fsspec.filesystem("s3", **options)
    bucket = f"preflight-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    fs.pipe_file(f"{bucket}/m/config.json", json.dumps(LLAMA).encode())
    fs.pipe_file(f"{bucket}/m/model.safetensors", b"not read by the check")
    check = preflight(f"s3://{bucket}/m/", storage_options=options)
    assert check.architecture == "LlamaForCausalLM" and check.where == f"s3://{bucket}/m/config.json"
    with pytest.raises(ModelSourceError, match="no config.json there"):
        preflight(f"s3://{bucket}/nothing", storage_options=options)


def test_a_hub_id_offline_without_a_cached_config_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelSourceError, match=r"'Qwen/Qwen3-30B-A3B': cannot read its config.json from the "
                                               r"Hugging Face Hub \(HF_HUB_OFFLINE is set"):
        preflight("Qwen/Qwen3-30B-A3B")


def test_validate_refuses_an_unsupported_model_before_reading_any_weight(tmp_path):
    folder = _config_dir(tmp_path, model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=64, n_layer=2,
                         n_head=4)
    for name in ("model.safetensors", "tokenizer.json"):  # present, so the source itself looks complete
        (folder / name).write_text("x")
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: j\nmodel: {{source: {folder}}}\ninput: {{url: {tmp_path}/in.parquet, prompt_column: p}}"
                    f"\noutput: {{url: {tmp_path}/out}}\n")
    result = CliRunner().invoke(main, ["validate", str(spec)])
    assert result.exit_code == 1
    assert "model.source: " in result.output and "unsupported model architecture 'GPT2LMHeadModel'" in result.output



@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_a_moe_config_counts_every_expert_as_transformers_does(tmp_path, arch):
    from tests.engine.tiny_moe import make_hf_moe

    hf = make_hf_moe(arch)
    folder = tmp_path / arch
    hf.config.save_pretrained(folder)  # config.json only
    check = preflight(str(folder))
    assert check.architecture == hf.config.architectures[0]
    assert check.num_params == sum(p.numel() for p in hf.parameters())  # all experts resident


def test_an_alias_is_checked_from_its_conversion_when_there_is_one(tmp_path, monkeypatch):
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path))
    assert preflight("gemma3-270m") is None  # not converted yet: checked when converted, on first load
    converted = tmp_path / "models" / "gemma3-270m"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text(json.dumps(LLAMA))
    check = preflight("gemma3-270m")
    assert check.architecture == "LlamaForCausalLM" and str(converted) in check.where
