"""`jobrunner bench --engine jobrunner,vllm`: both engines on the same token ids in one command, with the ratio
(real vLLM, eager to keep the start short; `make test-heavy`: the vLLM process it drives is the engine.backend
vllm path, which tests/vllm_backend/test_vllm_engine.py holds in the default suite); and the option's errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from jobrunner.cli import main
from tests.vllm_backend.vllm_python import vllm_python_or_skip

pytestmark = pytest.mark.timeout(600)


def _prompts(tmp_path: Path) -> Path:
    path = tmp_path / "p.jsonl"
    texts = ["What is the capital of France?", "Name three colours.", "Count to five.", "Say hello."]
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path


@pytest.mark.heavy
def test_both_engines_on_the_same_token_ids(tmp_path):
    python = vllm_python_or_skip()
    args = ["bench", "--prompts", str(_prompts(tmp_path)), "--num-prompts", "4", "--max-tokens", "8",
            "--ignore-eos", "--dtype", "float32", "--engine", "jobrunner,vllm", "--vllm-python", python,
            "--vllm-eager", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    ours, theirs = out["ours"], out["baseline"]
    assert theirs["name"] == "vllm" and theirs["vllm_version"] and theirs["eager"] is True
    assert ours["num_prompt_tokens"] == theirs["num_prompt_tokens"] > 0  # the same token ids
    assert ours["num_output_tokens"] == theirs["num_output_tokens"] == 32 and theirs["num_errors"] == 0
    assert out["ratio"] == pytest.approx(ours["output_tokens_per_s"] / theirs["output_tokens_per_s"])
    assert "ours / vllm: output tokens/s x" in result.stdout and "vllm 0." in result.stdout


@pytest.mark.parametrize(("extra", "message"), [
    (["--engine", "vllm"], "jobrunner or jobrunner,vllm"),
    (["--engine", "jobrunner,sglang"], "jobrunner or jobrunner,vllm"),
    (["--engine", "jobrunner,vllm", "--baseline", "hf"], "drop --baseline"),
])
def test_engine_option_errors(tmp_path, extra, message):
    result = CliRunner().invoke(main, ["bench", "--prompts", str(_prompts(tmp_path)), *extra])
    assert result.exit_code == 2 and message in result.output


def test_the_default_vllm_python_keeps_the_venv(tmp_path, monkeypatch):
    """``./.venv-vllm/bin/python`` is a symlink to the base interpreter: following it would leave the venv
    (and its vLLM) behind, so the default is the link's absolute path, not its target."""
    from jobrunner.cli.bench import _vllm_python
    from jobrunner.vllm_backend.mapping import VLLM_PYTHON_ENV

    base = tmp_path / "base" / "python3"
    base.parent.mkdir()
    base.write_text("")
    venv_bin = tmp_path / "work" / ".venv-vllm" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").symlink_to(base)
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)
    assert _vllm_python(None) == str(venv_bin / "python")
    assert _vllm_python("/opt/v/bin/python") == "/opt/v/bin/python"
    monkeypatch.setenv(VLLM_PYTHON_ENV, "/env/python")
    assert _vllm_python(None) == "/env/python"
