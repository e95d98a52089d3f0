"""`jobrunner validate` tokenizes the rows' prompts as a worker would and names the rows that cannot fit the
context (prompt alone: error rows; prompt + max_tokens: output cut at the context) before any worker starts."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from click.testing import CliRunner

from jobrunner.cli import main


def _job(tmp_path: Path, model: str, prompts: list[str], **engine) -> Path:
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    spec = {"name": "lengths", "model": {"source": model}, "task": "generate",
            "input": {"url": str(data), "prompt_column": "prompt", "id_column": "id"},
            "sampling": {"max_tokens": 16}, "engine": engine, "output": {"url": str(tmp_path / "out")}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_rows_over_the_context_are_named(tiny_llama_hf_dir: Path, tmp_path: Path) -> None:
    from jobrunner.models.weights import load_tokenizer

    tokenizer = load_tokenizer(tiny_llama_hf_dir)
    near = "word"
    while len(tokenizer(near)["input_ids"]) < 56:  # fits the 64-token context, not with 16 tokens more
        near += " word"
    assert len(tokenizer(near)["input_ids"]) < 64
    prompts = ["hello world"] * 3 + [near, "word " * 200]
    result = CliRunner().invoke(main, ["validate", str(_job(tmp_path, str(tiny_llama_hf_dir), prompts,
                                                            max_model_len=64))])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith(("prompt lengths", "WARNING"))]
    assert lines[0].startswith("prompt lengths (all 5 rows read): longest prompt ")
    assert "longest prompt 1000+ tokens (row 'r4'; counted to past the context) of the 64-token context" in lines[0]
    assert lines[1].startswith("WARNING: 1 row(s) have a prompt of the whole context or more and will be error "
                               "rows (ids 'r4')")
    assert lines[2].startswith("WARNING: 1 row(s) cannot get sampling.max_tokens before the context ends "
                               "(ids 'r3')")


def test_a_tokenizer_not_on_this_machine_is_not_fetched(tmp_path: Path) -> None:
    from jobrunner.driver.length_check import tokenizer_for_check

    tokenizer, why = tokenizer_for_check("some-org/not-downloaded-model")
    assert tokenizer is None and "jobrunner fetch some-org/not-downloaded-model" in why
