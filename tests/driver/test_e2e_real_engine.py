"""End to end with the real engine and the embedded default model on a slice of the committed sample."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobrunner.driver.job import run_job
from jobrunner.engine import EngineConfig, LLMEngine, SamplingParams
from jobrunner.io.parts import read_output
from jobrunner.spec import load_spec
from tests.driver.helpers import REPO, read_manifest_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_example_job_on_real_engine(local_ray, tmp_path):
    sample = pq.read_table(REPO / "examples" / "data" / "prompts.parquet").slice(40, 10)
    messages = sample.column("messages").to_pylist()
    messages[3] = []  # one bad row: it becomes an error row, the shard still commits
    index = sample.schema.get_field_index("messages")
    table = sample.set_column(index, "messages", pa.array(messages, sample.schema.field("messages").type))
    pq.write_table(table, tmp_path / "slice.parquet", row_group_size=5)
    spec = load_spec(REPO / "jobs" / "example.yaml", [
        f"input.url={tmp_path / 'slice.parquet'}", "input.rows_per_shard=5", "sampling.max_tokens=8",
        "model.dtype=float32",
        f"output.url={tmp_path / 'out'}", "cluster.num_cpus_per_worker=1"])
    result = run_job(spec, show_progress=False)
    assert result.ok, result.summary()
    out = {r["id"]: r for r in read_output(str(tmp_path / "out")).to_pylist()}
    assert sorted(out) == sorted(sample.column("id").to_pylist())
    bad_id = sample.column("id")[3].as_py()
    assert out[bad_id]["finish_reason"] == "error" and "messages column" in out[bad_id]["error"]
    good = [r for i, r in out.items() if i != bad_id]
    assert all(r["finish_reason"] in ("stop", "length") and r["generated_text"] is not None for r in good)
    # The content: the engine's own greedy output for the same chats, outside Ray and the driver.
    system = [{"role": "system", "content": spec.input.system_prompt}]
    expected = _reference_texts([system + messages[i] for i in range(10) if i != 3], spec.sampling)
    good_ids = [sample.column("id")[i].as_py() for i in range(10) if i != 3]
    assert {i: out[i]["generated_text"] for i in good_ids} == dict(zip(good_ids, expected, strict=True))
    assert all(0 < r["num_output_tokens"] <= 8 and r["num_prompt_tokens"] > 0 for r in good)
    assert all(r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"] for r in good)
    assert {r["source"] for r in good} <= {"gsm8k_test", "mt_bench_question"}
    manifest = read_manifest_file(tmp_path / "out")
    assert manifest["totals"]["rows"] == 10 and manifest["totals"]["num_errors"] == 1
    worker = manifest["workers"]["w0"]
    # the engine's own accounting agrees with the rows: each row's first token comes from its prefill step, every
    # later one from a decode step (no preemption: 9 rows in a batch of 32) whose query tokens also hold the
    # draft tokens that speculation (auto) verified and rejected; so decode time was spent
    output_tokens = [r["num_output_tokens"] for r in good]
    assert worker["num_requests"] == 9 and worker["num_output_tokens"] == sum(output_tokens)
    rejected = worker["num_draft_tokens"] - worker["num_accepted_tokens"]
    assert worker["num_decode_tokens"] == sum(n - 1 for n in output_tokens) + rejected > 0
    assert worker["num_prompt_tokens"] == sum(r["num_prompt_tokens"] for r in good)
    assert worker["num_prefill_tokens"] == worker["num_prompt_tokens"] - worker["num_cached_tokens"]
    assert worker["prefill_s"] > 0 and worker["decode_s"] > 0 and worker["steps"] > 0
    assert manifest["model"]["source"] == "smollm2-135m-instruct"
    # start-up by stage (issue 29 item 8): every stage of our engine's load is named, and they add up
    stages = worker["startup_stages_s"]
    assert list(stages) == ["process", "wait", "imports", "model_source", "config", "build_model", "load_weights",
                            "pack_weights", "tokenizer", "engine", "other"]
    assert abs(sum(stages.values()) - worker["startup_s"]) < 0.05 and stages["load_weights"] > 0
    seen = manifest["runs"][-1]["startup"]
    assert seen["plan_s"] > 0 and set(seen["workers"]) == {"w0"}
    assert 0 < seen["workers"]["w0"]["placed_s"] <= seen["workers"]["w0"]["ready_s"]
    assert "start-up: planning" in result.summary() and "weights" in result.summary()


def _reference_texts(chats: list, sampling) -> list[str]:
    engine = LLMEngine.from_source("smollm2-135m-instruct", dtype="float32",
                                   config=EngineConfig(device="cpu", max_num_seqs=32))
    outputs = engine.generate(chats, SamplingParams.from_dict(sampling.engine_values()))
    return [o.text for o in outputs]
