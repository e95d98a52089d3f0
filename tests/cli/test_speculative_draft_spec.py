"""engine.speculative = a draft model source: checked by validate like model.source, loaded by the worker."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from click.testing import CliRunner

from jobrunner.cli import main
from jobrunner.driver.engine_factory import build_engine, rebuild_engine
from jobrunner.engine import SamplingParams
from jobrunner.spec import spec_from_dict

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.driver.helpers import fake_spec, write_prompts  # noqa: E402


def test_a_local_draft_dir_loads_and_survives_a_rebuild(tiny_llama_hf_dir):
    spec = spec_from_dict({"name": "t", "model": {"source": str(tiny_llama_hf_dir), "dtype": "float32"},
                           "input": {"url": "x.parquet", "prompt_column": "prompt"}, "output": {"url": "out"},
                           "engine": {"speculative": str(tiny_llama_hf_dir), "device": "cpu",
                                      "num_kv_blocks": 32}})
    engine = build_engine(spec)  # the target as its own draft: loaded from the directory, tokenizer checked
    assert engine.draft is not None and engine.model_info["draft_source"] == str(tiny_llama_hf_dir)
    engine.speculator.every_step = True
    out = engine.generate(["hello there"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 8 and engine.stats().num_accepted_tokens > 0
    rebuilt, reloaded = rebuild_engine(engine, spec)
    assert not reloaded and rebuilt.draft.model is engine.draft.model  # the draft's weights are kept too


def test_validate_checks_the_draft_source(tmp_path, tiny_llama_hf_dir):
    write_prompts(tmp_path / "in.parquet", 4)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out"))))
    base = ["validate", str(job), "--set", "engine.factory=null"]
    bad = CliRunner().invoke(main, base + ["--set", "engine.speculative=ngarm"])
    assert bad.exit_code == 1 and bad.output.count("Error:") == 1
    assert "engine.speculative: model source 'ngarm' is not a known alias" in bad.output
    assert "(engine.speculative is off|auto|ngram or a draft model source)" in bad.output
    good = CliRunner().invoke(main, base + ["--set", f"engine.speculative={tiny_llama_hf_dir}"])
    assert good.exit_code == 0, good.output
    assert f"; draft model local directory {tiny_llama_hf_dir}" in good.output
