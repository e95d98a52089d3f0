"""``jobrunner validate`` reads a checkpoint's quantization_config from config.json alone: a format we do not load
is refused in one line naming it, and a spec's model.quantization that conflicts with it is refused naming both."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from jobrunner.cli import main
from jobrunner.models.preflight import preflight
from jobrunner.models.sources import ModelSourceError

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=384, hidden_size=128,
             intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, tie_word_embeddings=False)
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq", "pack_dtype": "int32"}


def _model_dir(tmp_path: Path, quantization_config: dict) -> Path:
    """config.json (plus stand-ins for weights and tokenizer, never read by the check)."""
    folder = tmp_path / f"model-{uuid.uuid4().hex[:6]}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA, "quantization_config": quantization_config}))
    for name in ("model.safetensors", "tokenizer.json"):
        (folder / name).write_text("x")
    return folder


def _validate(tmp_path: Path, folder: Path, quantization: str = "none"):
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: j\nmodel: {{source: {folder}, quantization: {quantization}}}\n"
                    f"input: {{url: {tmp_path}/in.parquet, prompt_column: p}}\noutput: {{url: {tmp_path}/out}}\n")
    return CliRunner().invoke(main, ["validate", str(spec)])


def test_a_supported_checkpoint_is_described_with_its_format(tmp_path):
    check = preflight(str(_model_dir(tmp_path, GPTQ)))
    line = check.describe("auto", "none")
    assert "(weights: 0.00 GB as int4)" in line
    assert "; pre-quantized checkpoint: gptq 4-bit, group 128, symmetric (v1 zeros), loaded as it is;" in line
    assert check.describe("auto", "int4") == line


@pytest.mark.parametrize(("changes", "named"), [
    ({"desc_act": True}, "gptq desc_act: true (activation order)"),
    ({"bits": 3}, "gptq bits 3"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
])
def test_validate_refuses_a_format_we_do_not_load_naming_it(tmp_path, changes, named):
    with pytest.raises(ModelSourceError, match="checkpoint quantization_config: "):
        preflight(str(_model_dir(tmp_path, {**GPTQ, **changes})))
    result = _validate(tmp_path, _model_dir(tmp_path, {**GPTQ, **changes}))
    assert result.exit_code == 1
    errors = [line for line in result.output.splitlines() if "quantization_config" in line]
    assert len(errors) == 1 and named in errors[0] and errors[0].startswith("Error: model.source: ")


def test_validate_refuses_a_spec_quantization_that_conflicts_with_the_checkpoint(tmp_path):
    result = _validate(tmp_path, _model_dir(tmp_path, GPTQ), quantization="int8")
    assert result.exit_code == 1
    assert ("model.quantization 'int8' conflicts with the checkpoint's own quantization (gptq 4-bit, group 128, "
            "symmetric (v1 zeros), loaded as int4)") in result.output
