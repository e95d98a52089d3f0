"""A whole job through engine.backend openai (Ray, the driver, committed parts) against vLLM's server behind the
fault proxy: the spending cap stops the run cleanly (no shard charged, the rest left pending with the reason),
the rerun finishes without redoing a committed part, every id once, the usage tokens in the rows and the
manifest, the token-priced cost in the report, and the API key nowhere in what the job wrote."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest

from jobrunner.driver.job import run_job
from jobrunner.io.parts import read_output
from jobrunner.reports.job import load_report
from jobrunner.spec import load_spec
from tests.driver.helpers import REPO, read_manifest_file
from tests.endpoint.proxy import FaultProxy

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(900)]
KEY = "sk-endpoint-job-key-4b1f9c2e7d0a55aa"


def _spec(tmp_path, url: str, max_usd: float, *extra: str):
    return load_spec(REPO / "jobs" / "example.yaml", [
        f"input.url={tmp_path / 'rows.parquet'}", "input.rows_per_shard=4", "sampling.max_tokens=8",
        "sampling.repetition_penalty=1.0", f"output.url={tmp_path / 'out'}", "cluster.num_cpus_per_worker=1",
        "engine.backend=openai", f"engine.endpoint.base_url={url}", "engine.endpoint.model=smollm2",
        "engine.endpoint.api_key=${env:EP_JOB_KEY}", "engine.endpoint.max_concurrency=2",
        "engine.endpoint.max_retries=20", "cost.usd_per_m_input=1000", "cost.usd_per_m_output=2000",
        f"cost.max_usd={max_usd}", *extra])


def test_spending_cap_stops_resumable_and_the_rerun_finishes(local_ray, vllm_endpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("EP_JOB_KEY", KEY)
    rows = pq.read_table(REPO / "examples" / "data" / "prompts.parquet").slice(0, 16)
    pq.write_table(rows, tmp_path / "rows.parquet")
    out = tmp_path / "out"
    with FaultProxy(vllm_endpoint.url, seed=5, rate_429=0.2, retry_after="0", expect_key=KEY) as proxy:
        # each row ~90 prompt tokens + 8 output tokens: ~$0.1 at these prices; $0.6 lets a shard and a bit go
        first = run_job(_spec(tmp_path, proxy.url, 0.6), show_progress=False)
        assert not first.ok and "cost.max_usd reached" in first.error and "resumable" in first.error
        manifest = read_manifest_file(out)
        committed = sorted((out / "parts").iterdir())
        assert 1 <= len(committed) < 4
        assert manifest["workers"]["w0"]["cost_usd"] <= 0.6
        assert manifest["runs"][0]["status"] == "failed"
        mtimes = {p.name: p.stat().st_mtime_ns for p in committed}
        sent_first = len(proxy.forwarded())

        second = run_job(_spec(tmp_path, proxy.url, 100.0), show_progress=False)
        assert second.ok, second.summary()
        assert {p.name: p.stat().st_mtime_ns for p in committed} == mtimes  # not redone
        assert all(r.outcome != "401" for r in proxy.records)  # the key reached the server every time
        sent = len(proxy.forwarded())
    table = read_output(str(out)).to_pylist()
    assert sorted(r["id"] for r in table) == sorted(rows.column("id").to_pylist())
    assert all(r["error"] is None and r["num_prompt_tokens"] > 0 and 0 < r["num_output_tokens"] <= 8 for r in table)
    retries_at_proxy = sum(r.outcome == "429" for r in proxy.records)
    assert 0 < sum(r["num_retries"] for r in table) <= retries_at_proxy  # the committed rows' own retries
    assert sent - sent_first == 16 - 4 * len(committed) and sent_first <= 16 // 4 * 4  # in flight, then the rest
    manifest = read_manifest_file(out)
    assert manifest["model"]["backend"] == "openai" and manifest["model"]["endpoint_model"] == "smollm2"
    assert manifest["spec"]["engine"]["endpoint"]["api_key"] == "***"
    report = load_report(str(out))
    priced = report["cost"]["token_priced"]
    tokens = report["tokens"]
    assert priced["usd_per_m_input"] == 1000 and priced["usd_per_m_output"] == 2000
    assert priced["total_usd"] == pytest.approx((tokens["input"] * 1000 + tokens["output"] * 2000) / 1e6)
    assert priced["spent_usd"] >= priced["total_usd"]  # the first run's rows sent but not committed are paid too
    leaks = [str(p) for p in out.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
    assert leaks == []
    assert os.environ["EP_JOB_KEY"] == KEY


def test_a_row_whose_retries_run_out_is_an_error_row_and_the_job_goes_on(local_ray, vllm_endpoint, tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("EP_JOB_KEY", KEY)
    rows = pq.read_table(REPO / "examples" / "data" / "prompts.parquet").slice(0, 8)
    pq.write_table(rows, tmp_path / "rows.parquet")
    marker = rows.column("messages")[5].as_py()[0]["content"][:40]
    with FaultProxy(vllm_endpoint.url, seed=2, rate_429=0.2, retry_after="0", expect_key=KEY,
                    always_429=json.dumps(marker)[1:-1]) as proxy:
        spec = _spec(tmp_path, proxy.url, 100.0, "output.max_error_rate=0.5", "engine.endpoint.max_retries=3")
        result = run_job(spec, show_progress=False)
    assert result.ok, result.summary()
    table = {r["id"]: r for r in read_output(str(tmp_path / "out")).to_pylist()}
    assert sorted(table) == sorted(rows.column("id").to_pylist())
    bad = table[rows.column("id")[5].as_py()]
    assert bad["finish_reason"] == "error" and bad["num_retries"] == 3
    assert bad["error"] == ("endpoint: gave up after 4 attempts (engine.endpoint.max_retries=3); last: HTTP 429: rate "
                            "limited by the fault proxy")
    assert [r["id"] for r in table.values() if r["error"]] == [bad["id"]]
