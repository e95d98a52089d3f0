"""A job whose rows name LoRA adapters (input.adapter_column), on the real engine (tiny random Llama + two random
peft adapters), real local Ray and local disk: each row's text is the engine's own greedy output with that
row's adapter, an unknown adapter is an error row naming the row and the adapter, the manifest lists the
adapters and the report counts rows and tokens per adapter."""

from __future__ import annotations

import json

import pytest

from jobrunner.driver.job import run_job
from jobrunner.engine import EngineConfig, LLMEngine, SamplingParams
from jobrunner.io.parts import read_output
from jobrunner.io.report_reader import open_outputs
from jobrunner.reports.build import build_report
from jobrunner.reports.text import render_text
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import read_manifest_file
from tests.lora_adapters import save_random_adapter

pytestmark = pytest.mark.timeout(600)

ROWS = [("r0", "hello world", "sql"), ("r1", "hello world", "chat"), ("r2", "hello world", None),
        ("r3", "the quick fox", ""), ("r4", "the quick fox", "nope"), ("r5", "the quick fox", "sql")]


def _save_adapter(model_dir, out_dir, seed: int, **config) -> None:
    from transformers import AutoModelForCausalLM

    save_random_adapter(AutoModelForCausalLM.from_pretrained(str(model_dir)), out_dir, seed, scale=0.5, **config)


def test_rows_run_with_their_adapter(local_ray, tmp_path, tiny_llama_hf_dir):
    _save_adapter(tiny_llama_hf_dir, tmp_path / "sql", 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    _save_adapter(tiny_llama_hf_dir, tmp_path / "chat", 2, r=2, lora_alpha=4,
                  target_modules=["o_proj", "gate_proj", "down_proj"])
    adapters = {"sql": str(tmp_path / "sql"), "chat": f"file://{tmp_path / 'chat'}"}
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"id": i, "prompt": p, "adapter": a}) + "\n"
                                                 for i, p, a in ROWS))
    spec = spec_from_dict({
        "name": "lora-job", "model": {"source": str(tiny_llama_hf_dir), "dtype": "float32", "adapters": adapters},
        "input": {"url": str(tmp_path / "rows.jsonl"), "prompt_column": "prompt", "id_column": "id",
                  "adapter_column": "adapter", "rows_per_shard": 3},
        "sampling": {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True},
        "engine": {"max_num_seqs": 8, "num_kv_blocks": 64, "speculative": "off"},
        "cluster": {"num_workers": 1, "num_cpus_per_worker": 1, "retry_backoff_s": 0.1},
        "output": {"url": str(tmp_path / "out"), "mode": "overwrite", "max_error_rate": 1.0}})
    result = run_job(spec, show_progress=False)
    assert result.ok, result.summary()
    out = {r["id"]: r for r in read_output(str(tmp_path / "out")).to_pylist()}
    assert {i: out[i]["adapter"] for i in out} == {"r0": "sql", "r1": "chat", "r2": None, "r3": None, "r4": None,
                                                   "r5": "sql"}
    assert out["r4"]["finish_reason"] == "error"
    assert "unknown adapter 'nope'" in out["r4"]["error"] and "row r4" in out["r4"]["error"]
    expected = _reference(tiny_llama_hf_dir, adapters)
    assert {i: out[i]["generated_text"] for i in expected} == expected
    assert len({expected["r0"], expected["r1"], expected["r2"]}) == 3  # each adapter changes the output
    manifest = read_manifest_file(tmp_path / "out")
    listed = {a["name"]: a for a in manifest["model"]["adapters"]}
    assert listed["sql"]["rank"] == 4 and listed["sql"]["targets"] == ["q_proj", "v_proj"]
    assert listed["chat"]["rank"] == 2 and listed["chat"]["targets"] == ["down_proj", "gate_proj", "o_proj"]
    assert listed["chat"]["source"] == adapters["chat"] and listed["sql"]["bytes"] > 0
    report = build_report(open_outputs(str(tmp_path / "out")))
    per = report["adapters"]
    assert {k: (v["rows"], v["errors"]) for k, v in per.items()} == {
        "(base model)": (3, 1), "chat": (1, 0), "sql": (2, 0)}
    assert per["sql"]["output_tokens"] == 10 and per["sql"]["input_tokens"] == \
        out["r0"]["num_prompt_tokens"] + out["r5"]["num_prompt_tokens"]
    assert "adapter sql: 2 rows" in render_text([report])


def _reference(model_dir, adapters: dict[str, str]) -> dict[str, str]:
    """Each good row's text from the engine itself (outside Ray and the driver), with its adapter."""
    engine = LLMEngine.from_source(str(model_dir), dtype="float32", adapters=adapters,
                                   config=EngineConfig(num_kv_blocks=64, speculative="off"))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for row_id, prompt, adapter in ROWS:
        if adapter != "nope":
            engine.add_request(row_id, prompt, params, adapter=adapter or None)
    texts = {}
    while engine.has_unfinished_requests():
        texts.update((o.request_id, o.text) for o in engine.step())
    return texts
