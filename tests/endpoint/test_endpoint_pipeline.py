"""Issue 48 item 3: generate with our engine -> judge through the endpoint (vLLM's OpenAI server behind the fault
proxy: slow answers and 429s) -> a last stage on our engine, the driver killed with SIGKILL mid-judge and rerun:
every id once per stage, nothing committed recomputed (stage-1 parts' mtimes; each committed judge row sent to
the server once), the final ids = the ids that passed the filters, the funnel counts right."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import ray
import yaml

from jobrunner.driver.pipeline import run_pipeline
from jobrunner.pipeline.expr import parse_filter
from jobrunner.pipeline.handoff import first_json_object
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import REPO
from tests.driver.test_pipeline_jobs import _committed, _ids, _mtimes, _wait_for
from tests.endpoint.proxy import FaultProxy

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(1200)]
N = 16
JUDGE_FILTER = "json_valid and score >= 3"
SCHEMA = {"type": "object", "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 10}},
          "required": ["score"], "additionalProperties": False}


def _pipeline(tmp_path, endpoint_url: str) -> dict:
    judge_engine = {"backend": "openai", "endpoint": {"base_url": endpoint_url, "model": "smollm2",
                                                      "max_concurrency": 2, "max_retries": 20}}
    return {"name": "ep-pipeline", "model": {"source": "smollm2-135m-instruct", "dtype": "float32"},
            "input": {"url": str(tmp_path / "rows.parquet"), "messages_column": "messages", "id_column": "id",
                      "rows_per_shard": 4, "system_prompt": "Answer briefly: at most two sentences."},
            "sampling": {"max_tokens": 24, "temperature": 0.0, "repetition_penalty": 1.1},
            "engine": {"max_num_seqs": 16},
            "cluster": {"num_workers": 1, "num_cpus_per_worker": 0.5, "retry_backoff_s": 0.1},
            "output": {"url": str(tmp_path / "out"), "mode": "resume", "lease_ttl_s": 120.0},
            "stages": [
                {"name": "answer"},
                {"name": "judge", "engine": judge_engine, "cost": {"usd_per_m_input": 0.5, "usd_per_m_output": 1.5},
                 "sampling": {"max_tokens": 12, "repetition_penalty": 1.0, "json_schema": SCHEMA},
                 "input": {"prompt": "Rate the answer from 1 to 10.\nQuestion: {prompt}\nAnswer: {generated_text}\n"
                                     "JSON:"},
                 "output_columns": {"score": "json.score"}, "filter": JUDGE_FILTER},
                {"name": "shorten", "sampling": {"max_tokens": 8},
                 "input": {"prompt": "In one sentence: {answer.generated_text}"}, "filter": "num_output_tokens >= 1"}]}


def test_endpoint_judge_pipeline_killed_mid_judge_and_rerun(local_ray, vllm_endpoint, tmp_path):
    rows = pq.read_table(REPO / "examples" / "data" / "prompts.parquet").slice(0, N)
    pq.write_table(rows, tmp_path / "rows.parquet")
    ids = sorted(rows.column("id").to_pylist())
    out = tmp_path / "out"
    stages = {name: out / "stages" / name for name in ("answer", "judge", "shorten")}
    with FaultProxy(vllm_endpoint.url, seed=11, rate_429=0.2, retry_after="0", rate_slow=1.0, slow_s=0.5) as proxy:
        data = _pipeline(tmp_path, proxy.url)
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(data))
        cmd = [sys.executable, "-c", "from jobrunner.cli import main; main()", "run", str(tmp_path / "job.yaml"),
               "--address", ray.get_runtime_context().gcs_address, "--no-progress", "--no-report"]
        driver = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_for(lambda: len(_committed(stages["judge"])) >= 1, timeout=600)
        finally:
            os.kill(driver.pid, signal.SIGKILL)
            driver.wait()
        before = {name: _committed(path) for name, path in stages.items()}
        assert 1 <= len(before["judge"]) < N // 4, "the judge was not killed mid-stage"
        parts_before = {name: _mtimes(path / "parts") for name, path in stages.items()}
        started = time.monotonic()
        result = run_pipeline(spec_from_dict(data), show_progress=False)
        rerun_s = time.monotonic() - started
        assert result.ok, result.summary()
        forwarded = proxy.forwarded()
        print(f"\nrerun {rerun_s:.1f}s; committed before the kill: "
              + ", ".join(f"{k} {len(v)}" for k, v in before.items())
              + f"; requests at the proxy {len(proxy.records)} ({len(forwarded)} forwarded)")

    for name, path in stages.items():  # committed parts untouched, every id once
        now = _mtimes(path / "parts")
        assert {k: now[k] for k in parts_before[name]} == parts_before[name], f"{name}: a committed part rewritten"
        got = _ids(path / "parts")
        assert len(got) == len(set(got)), name
    answers = {r["id"]: r for r in pq.read_table(stages["answer"] / "parts").to_pylist()}
    assert sorted(answers) == ids and all(r["error"] is None for r in answers.values())
    judged = {r["id"]: r for r in pq.read_table(stages["judge"] / "parts").to_pylist()}
    assert sorted(judged) == ids and all(r["error"] is None for r in judged.values())
    prompts = {r["id"]: r["_stage_prompt"] for r in pq.read_table(stages["judge"] / "_input").to_pylist()}
    # a judge row committed before the kill reached the server once in all (its part was never redone)
    for shard_id in before["judge"]:
        for row in pq.read_table(stages["judge"] / "parts" / f"part-{shard_id}.parquet").to_pylist():
            sent = [r for r in forwarded if prompts[row["id"]] in _texts(r.body)]
            assert len(sent) == 1, (row["id"], len(sent))
    scores = {i: (first_json_object(r["generated_text"]) or {}).get("score") for i, r in judged.items()}
    keep = parse_filter(JUDGE_FILTER)
    passed = sorted(i for i, s in scores.items() if keep.keeps({"json_valid": s is not None, "score": s}, i))
    assert _ids(stages["shorten"] / "parts") == passed
    shortened = {r["id"]: r for r in pq.read_table(stages["shorten"] / "parts").to_pylist()}
    final = sorted(i for i, r in shortened.items() if r["num_output_tokens"] >= 1)
    assert _ids(out / "parts") == final
    from jobrunner.reports.pipeline import load_pipeline_report

    report = load_pipeline_report(str(out))  # only the judge has token prices (its own cost section)
    priced = [s["report"]["cost"]["token_priced"] for s in report["stages"]]
    assert priced[0] is None and priced[2] is None and priced[1]["total_usd"] > 0
    assert report["total_usd"] == pytest.approx(priced[1]["total_usd"])  # no worker-hour price set
    funnel = {f["stage"]: (f["rows_in"], f["kept"], f["dropped"], f["error"]) for f in result.funnel}
    assert funnel == {"answer": (N, N, 0, 0), "judge": (N, len(passed), N - len(passed), 0),
                      "shorten": (len(passed), len(final), len(passed) - len(final), 0)}


def _texts(value: object) -> list[str]:
    """Every string in a request body (the prompt, or each message's content), at any depth."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _texts(v)]
    if isinstance(value, list):
        return [t for v in value for t in _texts(v)]
    return []
